//! The scaling policy: signals and the fleet as it is → a [`ScaleDecision`]. Pure: no clock,
//! no I/O; the caller passes `now` and keeps the [`ScaleHistory`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::api::v1alpha1::AutoscalingMode;

use super::signals::Signals;

/// Everything the policy is told by the user (through the `DataPipeline`) or defaults to.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoscalingPolicy {
    pub mode: AutoscalingMode,
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// The decoder count when `mode` is off.
    pub fixed_replicas: Option<u32>,
    /// Share (0..=1) of wall time a trainer may wait for data.
    pub target_data_wait: f64,
    /// Share (0..=1) of its link no node's NIC is pushed past.
    pub max_nic_utilization: f64,
    pub scale_up_stabilization: Duration,
    pub scale_down_stabilization: Duration,
    pub max_scale_up_step: u32,
    pub max_scale_down_step: u32,
    /// Capacity over the measured need, so that a small rise in demand does not starve at once.
    pub headroom: f64,
    /// Relative change of the decoder count below which nothing changes: noise never scales.
    pub tolerance: f64,
    /// Share of S3 requests throttled above which the fleet does not grow.
    pub max_s3_throttle_share: f64,
    /// Most of the work the sidecars may decode locally when their node's NIC is the bottleneck;
    /// local decode takes CPU from the trainer's node.
    pub max_local_decode_share: f64,
    /// The Prometheus window every rate is taken over.
    pub window: Duration,
    /// Link speed of nodes that neither node-exporter nor `stoker.dev/nic-gbps` describe.
    pub default_link_bytes_per_second: Option<f64>,
}

impl Default for AutoscalingPolicy {
    fn default() -> Self {
        Self {
            mode: AutoscalingMode::Auto,
            min_replicas: 1,
            max_replicas: 16,
            fixed_replicas: None,
            target_data_wait: 0.05,
            max_nic_utilization: 0.80,
            scale_up_stabilization: Duration::ZERO,
            scale_down_stabilization: Duration::from_secs(300),
            max_scale_up_step: 8,
            max_scale_down_step: 8,
            headroom: 1.2,
            tolerance: 0.1,
            max_s3_throttle_share: 0.01,
            max_local_decode_share: 0.5,
            window: Duration::from_secs(60),
            default_link_bytes_per_second: None,
        }
    }
}

/// The pipeline's pods as the operator sees them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecoderFleet {
    /// Decoders the fleet is asked to run now (`status.decoders.desired`).
    pub replicas: u32,
    /// Decoder pod → node it runs on.
    pub pods: BTreeMap<String, String>,
    /// Trainers (world size) now.
    pub trainers: u32,
    /// Node → trainer pods on it.
    pub trainer_nodes: BTreeMap<String, u32>,
    /// Link speeds from the nodes' `stoker.dev/nic-gbps` annotation.
    pub node_link_bytes_per_second: BTreeMap<String, f64>,
}

/// What the autoscaler remembers of one pipeline between decisions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScaleHistory {
    /// Recent recommendations (after the tolerance band), for the stabilization windows.
    recommendations: VecDeque<(Timestamp, u32)>,
    /// Last measured rate of one fully busy decoder, for when the fleet is idle.
    decoder_rate: Option<f64>,
    /// Demand of one unstarved trainer, learned while the trainer count held still.
    per_trainer_demand: Option<f64>,
    trainers: Option<u32>,
    /// When the trainer count last changed, and what it was before.
    trainer_change: Option<(Timestamp, u32)>,
    /// Node → when decoders were last moved off it.
    moved_at: BTreeMap<String, Timestamp>,
    local_decode_share: f64,
    /// In recommend mode the fleet does not follow, so "current" is the last recommendation.
    last_recommended: Option<u32>,
    decided_at: Option<Timestamp>,
}

impl ScaleHistory {
    /// Records a decision made at `now` so that the next one can be stabilized against it.
    pub fn remember(
        &mut self,
        decision: &ScaleDecision,
        policy: &AutoscalingPolicy,
        now: Timestamp,
    ) {
        let keep = policy
            .scale_up_stabilization
            .max(policy.scale_down_stabilization);
        if decision.conditions.metrics_unavailable {
            // Readings from before an outage say nothing about after it: a scale-down must
            // again wait out a full window of fresh ones.
            self.recommendations.clear();
        }
        if let Some(raw) = decision.learned.recommendation {
            self.recommendations.push_back((now, raw));
        }
        while self
            .recommendations
            .front()
            .is_some_and(|(t, _)| elapsed(*t, now) > keep.as_secs_f64())
        {
            self.recommendations.pop_front();
        }
        if decision.learned.decoder_rate.is_some() {
            self.decoder_rate = decision.learned.decoder_rate;
        }
        if decision.learned.per_trainer_demand.is_some() {
            self.per_trainer_demand = decision.learned.per_trainer_demand;
        }
        self.trainer_change = decision.learned.trainer_change;
        let settle = settle_seconds(policy);
        self.moved_at.retain(|_, t| elapsed(*t, now) < settle);
        for node in &decision.learned.moved_from {
            self.moved_at.insert(node.clone(), now);
        }
        self.trainers = Some(decision.learned.trainers);
        self.local_decode_share = decision.local_decode_share;
        self.last_recommended = Some(decision.recommended);
        self.decided_at = Some(now);
    }

    /// When the last decision was made.
    pub fn decided_at(&self) -> Option<Timestamp> {
        self.decided_at
    }

    /// The last recommendation, the fleet size in recommend mode.
    pub fn last_recommended(&self) -> Option<u32> {
        self.last_recommended
    }
}

/// The autoscaler's conditions for one decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScaleConditions {
    /// Trainers wait for data more than the target.
    pub starved: bool,
    /// Trainer nodes whose own NIC limits delivery: more decoders cannot help.
    pub network_saturated: Vec<String>,
    pub s3_throttled: bool,
    /// Prometheus unreachable or the sidecars' series absent: the size is kept.
    pub metrics_unavailable: bool,
}

/// What one decision saw, in the units of `status.observed`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObservedSummary {
    pub data_wait_percent: Option<f64>,
    pub gpu_utilization_percent: Option<f64>,
    pub samples_per_second: Option<f64>,
    pub max_nic_utilization_percent: Option<f64>,
    pub decoder_samples_per_second: Option<f64>,
    pub decoder_busy_percent: Option<f64>,
    pub s3_throttles_per_second: Option<f64>,
}

/// Values a decision measured that the next decisions build on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Learned {
    /// The recommendation before stabilization, step limits and bounds; `None` when nothing
    /// could be measured (it must not hold a later scale-down back).
    pub recommendation: Option<u32>,
    pub decoder_rate: Option<f64>,
    pub per_trainer_demand: Option<f64>,
    pub trainers: u32,
    /// When the trainer count changed and what it was before, while demand follows it.
    pub trainer_change: Option<(Timestamp, u32)>,
    /// Nodes decoders were moved off in this decision.
    pub moved_from: Vec<String>,
}

/// One decision of the autoscaler for one pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleDecision {
    /// The decoder count the decision started from.
    pub from: u32,
    /// The decoder count the policy recommends.
    pub recommended: u32,
    /// The decoder count the fleet should run: `recommended` in auto mode, minReplicas in
    /// recommend mode, the fixed count when off.
    pub replicas: u32,
    /// The decoder count the demand needs, in one step (demand × headroom ÷ per-decoder rate).
    pub needed: Option<u32>,
    /// Why, in numbers.
    pub reason: String,
    /// Nodes new decoders must not be placed on: their NIC is above the limit.
    pub avoid_nodes: Vec<String>,
    /// Decoders to drain and replace elsewhere: they push their node's NIC past the limit.
    pub move_pods: Vec<String>,
    /// Share (0..=1) of the work the sidecars decode themselves.
    pub local_decode_share: f64,
    pub conditions: ScaleConditions,
    pub observed: ObservedSummary,
    pub learned: Learned,
}

impl ScaleDecision {
    /// Whether the decision changes the decoder count.
    pub fn scales(&self) -> bool {
        self.replicas != self.from
    }
}

/// Trainers waiting this long are treated as waiting this long: beyond it the measured rate
/// says little about what they would consume (and 1 − wait would divide by ~0).
const MAX_USABLE_WAIT: f64 = 0.95;
/// Below this much busy time in the whole fleet (in decoder-seconds per second) the per-decoder
/// rate is noise; the last good measurement stands.
const MIN_BUSY_FOR_RATE: f64 = 0.1;
/// Bytes a NIC carries per payload byte: TCP/IP headers (~3.5% of a 1,500-byte frame), HTTP
/// and gRPC framing.
const WIRE_OVERHEAD: f64 = 1.05;
/// A local-decode share falls only by more than this, so that it does not follow noise.
const LOCAL_SHARE_BAND: f64 = 0.1;

/// Decides the decoder count and placement for one pipeline.
pub fn decide(
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    signals: Option<&Signals>,
    history: &ScaleHistory,
    now: Timestamp,
) -> ScaleDecision {
    let min = policy.min_replicas;
    let max = policy.max_replicas.max(min);
    let current = match policy.mode {
        AutoscalingMode::Recommend => history.last_recommended.unwrap_or(fleet.replicas),
        _ => fleet.replicas,
    };
    let mut d = ScaleDecision {
        from: fleet.replicas,
        recommended: current.clamp(min, max),
        replicas: fleet.replicas,
        needed: None,
        reason: String::new(),
        avoid_nodes: Vec::new(),
        move_pods: Vec::new(),
        local_decode_share: history.local_decode_share,
        conditions: ScaleConditions::default(),
        observed: ObservedSummary::default(),
        learned: Learned {
            decoder_rate: history.decoder_rate,
            trainers: fleet.trainers,
            trainer_change: history.trainer_change,
            ..Learned::default()
        },
    };

    if policy.mode == AutoscalingMode::Off {
        let fixed = policy.fixed_replicas.unwrap_or(min);
        d.recommended = fixed;
        d.replicas = fixed;
        d.local_decode_share = 0.0;
        d.reason = format!("autoscaling off: {fixed} decoders");
        return d;
    }

    let Some(s) = signals else {
        d.conditions.metrics_unavailable = true;
        d.reason = format!("Prometheus unreachable: keeping {} decoders", d.recommended);
        return finish(policy, d);
    };
    observe(&mut d, policy, fleet, s);
    let placement = place(&mut d, policy, fleet, s, history, now);

    if fleet.trainers == 0 {
        d.local_decode_share = 0.0;
        d.learned.recommendation = Some(min);
        d.reason = format!("no trainers: {min} decoders (minReplicas)");
        append_notes(&mut d.reason, &placement);
        return stabilize(policy, history, d, current, min, now, false);
    }
    let (Some(wait), Some(consumption)) = (s.data_wait_share, s.consumption_per_second) else {
        d.conditions.metrics_unavailable = true;
        d.reason = format!(
            "no data-wait or delivery series from {} trainers: keeping {} decoders",
            fleet.trainers, d.recommended
        );
        return finish(policy, d);
    };

    // Demand in one step: what the trainers would consume if never starved.
    let usable_wait = wait.clamp(0.0, MAX_USABLE_WAIT);
    let measured_demand = consumption / (1.0 - usable_wait);
    let starved = wait > policy.target_data_wait;
    d.conditions.starved = starved;

    // Elastic training: a new trainer count changes demand before any starvation shows; follow
    // it from the per-trainer demand until the window holds only the new count.
    if let Some(before) = history.trainers.filter(|t| *t != fleet.trainers) {
        // A second change while following keeps the count from before the first.
        let from = history.trainer_change.map_or(before, |(_, b)| b);
        d.learned.trainer_change = Some((now, from));
    }
    let following = history.per_trainer_demand.is_some()
        && d.learned
            .trainer_change
            .is_some_and(|(t, _)| elapsed(t, now) < settle_seconds(policy));
    let trainers_before = d.learned.trainer_change.map_or(fleet.trainers, |(_, b)| b);
    let demand = match history.per_trainer_demand {
        Some(per) if following => per * f64::from(fleet.trainers),
        _ => measured_demand,
    };
    if !following {
        let reporting = s.trainers_reporting.unwrap_or(fleet.trainers).max(1);
        d.learned.per_trainer_demand = Some(measured_demand / f64::from(reporting));
        d.learned.trainer_change = None;
    }

    let (sum_rate, sum_busy) = s.decoders.values().fold((0.0, 0.0), |(r, b), x| {
        (r + x.samples_per_second, b + x.busy_share)
    });
    if sum_busy >= MIN_BUSY_FOR_RATE && sum_rate > 0.0 {
        d.learned.decoder_rate = Some(sum_rate / sum_busy);
    }
    let busy_share = (!s.decoders.is_empty()).then(|| sum_busy / s.decoders.len() as f64);
    d.observed.decoder_busy_percent = busy_share.map(|b| b * 100.0);
    // A decoder behind a full NIC delivers what the NIC carries, not what its cores could:
    // with decoders spread one per node, that is the node's link at the limit.
    // Decoders that wait on their NIC are too idle to measure their own rate: the cap is it.
    let rate = match (d.learned.decoder_rate, nic_rate_cap(policy, fleet, s)) {
        (Some(r), Some(cap)) => Some(r.min(cap)),
        (None, cap) => cap,
        (r, None) => r,
    };
    d.observed.decoder_samples_per_second = rate;

    let throttle_share = match (s.s3_throttles_per_second, s.s3_requests_per_second) {
        (Some(t), Some(r)) if r > 0.0 => Some(t / r),
        _ => None,
    };
    let throttled = throttle_share.is_some_and(|t| t > policy.max_s3_throttle_share);
    d.conditions.s3_throttled = throttled;

    let saturated = trainer_network(
        &mut d,
        policy,
        fleet,
        s,
        history,
        demand,
        consumption,
        starved,
    );
    // Decoders serve only what the sidecars do not decode themselves.
    let network_demand = demand * (1.0 - d.local_decode_share);
    let needed = rate.map(|r| ceil_count(network_demand * policy.headroom / r));
    d.needed = needed;

    let wait_text = if starved {
        format!("data wait {} > {}", pct(wait), pct(policy.target_data_wait))
    } else {
        format!("data wait {} ≤ {}", pct(wait), pct(policy.target_data_wait))
    };
    let need_text = |n: u32, r: f64| {
        format!(
            "need {}/s at {}/s per decoder → {n}",
            count(network_demand),
            count(r)
        )
    };
    let (raw, reason) = if let Some(node) = saturated {
        (
            current,
            format!(
                "{wait_text}; trainer node {node} NIC above {}: more decoders cannot help; local decode {}",
                pct(policy.max_nic_utilization),
                pct(d.local_decode_share)
            ),
        )
    } else {
        let throttle_text = || {
            format!(
                "S3 throttles {} of requests > {}: not scaling up",
                pct(throttle_share.unwrap_or(0.0)),
                pct(policy.max_s3_throttle_share),
            )
        };
        match (needed, rate) {
            // Trainers starved with no decoder at all: nothing was delivered, so nothing
            // measures the demand; start one step up.
            _ if current == 0 && starved && !throttled => {
                let n = policy.max_scale_up_step.max(1);
                (n, format!("{wait_text} with no decoders → {n}"))
            }
            (Some(n), Some(r)) if n > current && throttled => (
                current,
                format!("{wait_text} but {} ({})", throttle_text(), need_text(n, r)),
            ),
            (Some(n), Some(r)) if following => (
                n,
                format!(
                    "trainers {trainers_before} → {}: {}",
                    fleet.trainers,
                    need_text(n, r)
                ),
            ),
            (Some(n), Some(r)) if n > current && !starved => (
                current,
                format!("{wait_text}: keeping {current} ({})", need_text(n, r)),
            ),
            (Some(n), Some(r)) if n < current && starved => (
                current,
                format!(
                    "{wait_text} but decoders only {} busy: the decoder count is not the bottleneck ({})",
                    pct(busy_share.unwrap_or(0.0)),
                    need_text(n, r)
                ),
            ),
            (Some(n), Some(r)) => (n, format!("{wait_text}: {}", need_text(n, r))),
            _ if starved && !throttled => {
                let n = current.saturating_add(policy.max_scale_up_step.max(1));
                (
                    n,
                    format!("{wait_text}: no per-decoder rate measured yet → {n}"),
                )
            }
            _ if starved => (current, format!("{wait_text} but {}", throttle_text())),
            _ => (
                current,
                format!("{wait_text}: no per-decoder rate measured yet: keeping {current}"),
            ),
        }
    };
    d.reason = reason;
    append_notes(&mut d.reason, &placement);

    // Tolerance band: small relative changes are noise. Bounds always win over the band.
    let in_bounds = (min..=max).contains(&current);
    let raw = if in_bounds
        && !following
        && raw != current
        && (f64::from(raw) - f64::from(current)).abs() <= policy.tolerance * f64::from(current)
    {
        d.reason.push_str(&format!(
            "; within the {} band of {current}: no change",
            pct(policy.tolerance)
        ));
        current
    } else {
        raw
    };
    d.learned.recommendation = Some(raw);
    let trainers_left = following && trainers_before > fleet.trainers;
    stabilize(policy, history, d, current, raw, now, trainers_left)
}

/// Applies the stabilization windows, step limits and bounds to the raw recommendation.
/// `skip_down_window`: the drop follows trainers that left, not a measurement that may be noise.
fn stabilize(
    policy: &AutoscalingPolicy,
    history: &ScaleHistory,
    mut d: ScaleDecision,
    current: u32,
    raw: u32,
    now: Timestamp,
    skip_down_window: bool,
) -> ScaleDecision {
    let min = policy.min_replicas;
    let max = policy.max_replicas.max(min);
    // The window's recommendations. Until the history spans the whole window (a fresh start,
    // an outage) the current size counts as one of them, so nothing moves on a short look.
    let within = |window: Duration| {
        let secs = window.as_secs_f64();
        let covered = history
            .recommendations
            .front()
            .is_some_and(|(t, _)| elapsed(*t, now) >= secs);
        history
            .recommendations
            .iter()
            .filter(move |(t, _)| elapsed(*t, now) < secs)
            .map(|(_, r)| *r)
            .chain((!covered && secs > 0.0).then_some(current))
    };
    let mut to = raw;
    if raw < current && !skip_down_window {
        // Like the HPA: the highest recommendation of the window, so one low reading never
        // removes decoders.
        let held = within(policy.scale_down_stabilization)
            .fold(raw, u32::max)
            .min(current);
        if held > raw {
            d.reason.push_str(&format!(
                "; scale-down window {}s holds {held}",
                policy.scale_down_stabilization.as_secs()
            ));
        }
        to = held;
    } else if raw > current && !policy.scale_up_stabilization.is_zero() {
        let held = within(policy.scale_up_stabilization)
            .fold(raw, u32::min)
            .max(current);
        if held < raw {
            d.reason.push_str(&format!(
                "; scale-up window {}s holds {held}",
                policy.scale_up_stabilization.as_secs()
            ));
        }
        to = held;
    }
    let up = current.saturating_add(policy.max_scale_up_step.max(1));
    let down = current.saturating_sub(policy.max_scale_down_step.max(1));
    let stepped = to.clamp(down, up);
    if stepped != to {
        d.reason.push_str(&format!("; step limit → {stepped}"));
    }
    let bounded = stepped.clamp(min, max);
    if bounded != stepped {
        let which = if bounded == min {
            "minReplicas"
        } else {
            "maxReplicas"
        };
        d.reason.push_str(&format!("; {which} {bounded}"));
    }
    d.recommended = bounded;
    finish(policy, d)
}

/// Sets the fleet size for the mode. Recommend mode acts on nothing.
fn finish(policy: &AutoscalingPolicy, mut d: ScaleDecision) -> ScaleDecision {
    let min = policy.min_replicas;
    d.recommended = d.recommended.clamp(min, policy.max_replicas.max(min));
    match policy.mode {
        AutoscalingMode::Auto => d.replicas = d.recommended,
        AutoscalingMode::Recommend => {
            d.replicas = min;
            d.move_pods.clear();
            d.local_decode_share = 0.0;
            d.reason = format!("recommend only: {}", d.reason);
        }
        AutoscalingMode::Off => {}
    }
    d
}

fn observe(d: &mut ScaleDecision, policy: &AutoscalingPolicy, fleet: &DecoderFleet, s: &Signals) {
    d.observed.data_wait_percent = s.data_wait_share.map(|w| w * 100.0);
    d.observed.gpu_utilization_percent = s.gpu_utilization_percent;
    d.observed.samples_per_second = s.consumption_per_second;
    d.observed.s3_throttles_per_second = s.s3_throttles_per_second;
    // The pipeline's own nodes: Prometheus answers for every node of the cluster.
    d.observed.max_nic_utilization_percent = fleet
        .pods
        .values()
        .chain(fleet.trainer_nodes.keys())
        .filter_map(|n| nic_utilization(policy, fleet, s, n))
        .reduce(f64::max)
        .map(|u| u * 100.0);
}

/// The node's NIC utilization, with its link speed from node-exporter, else the node's
/// `stoker.dev/nic-gbps` annotation, else the pipeline default.
fn nic_utilization(
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    s: &Signals,
    node: &str,
) -> Option<f64> {
    let nic = s.nodes.get(node)?;
    let link = link_of(policy, fleet, s, node)?;
    nic.utilization(link)
}

/// Samples per second one decoder can move through its node's NIC at `max_nic_utilization`,
/// over the largest link of the decoder-only nodes (new decoders avoid the hot ones), in the
/// busier direction: decoded bytes out usually, encoded bytes in when the sources are large or
/// the target small. `None` until something measures bytes per sample.
fn nic_rate_cap(policy: &AutoscalingPolicy, fleet: &DecoderFleet, s: &Signals) -> Option<f64> {
    // A trainer's node also carries its own traffic: its bytes are not the decoders'.
    let decoder_nodes: BTreeSet<&str> = fleet
        .pods
        .values()
        .map(String::as_str)
        .filter(|node| !fleet.trainer_nodes.contains_key(*node))
        .collect();
    let link = decoder_nodes
        .iter()
        .filter_map(|node| link_of(policy, fleet, s, node))
        .reduce(f64::max)
        .filter(|link| *link > 0.0)?;
    // The decoders' own counters first: a decoder that started inside the window is not
    // diluted by its node's idle seconds before it, as the node's NIC counters are.
    let per_sample =
        decoder_bytes_per_sample(s).or_else(|| nic_bytes_per_sample(fleet, s, &decoder_nodes))?;
    Some(link * policy.max_nic_utilization / per_sample)
}

/// Bytes the decoder-only nodes' NICs carried per sample their decoders delivered, in the busier
/// direction. `None` until those nodes have moved something.
fn nic_bytes_per_sample(
    fleet: &DecoderFleet,
    s: &Signals,
    decoder_nodes: &BTreeSet<&str>,
) -> Option<f64> {
    let samples: f64 = fleet
        .pods
        .iter()
        .filter(|(_, node)| decoder_nodes.contains(node.as_str()))
        .filter_map(|(pod, _)| s.decoders.get(pod))
        .map(|signal| signal.samples_per_second)
        .sum();
    let (received, sent) = decoder_nodes
        .iter()
        .filter_map(|node| s.nodes.get(*node))
        .fold((0.0, 0.0), |(rx, tx), nic| {
            (
                rx + nic.receive_bytes_per_second,
                tx + nic.transmit_bytes_per_second,
            )
        });
    let busier = f64::max(received, sent);
    (samples > 1.0 && busier > 0.0).then(|| busier / samples)
}

fn link_of(
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    s: &Signals,
    node: &str,
) -> Option<f64> {
    s.nodes
        .get(node)
        .and_then(|n| n.link_bytes_per_second)
        .or_else(|| fleet.node_link_bytes_per_second.get(node).copied())
        .or(policy.default_link_bytes_per_second)
}

/// Nodes to avoid and decoders to move: enough of a hot node's decoders that its NIC falls
/// back under the limit, assuming its traffic is theirs. Returns what it did, for the reason.
fn place(
    d: &mut ScaleDecision,
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    s: &Signals,
    history: &ScaleHistory,
    now: Timestamp,
) -> Vec<String> {
    let limit = policy.max_nic_utilization;
    let mut on_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (pod, node) in &fleet.pods {
        on_node.entry(node.as_str()).or_default().push(pod.as_str());
    }
    let mut moved = Vec::new();
    let mut notes = Vec::new();
    for node in s.nodes.keys() {
        let Some(util) = nic_utilization(policy, fleet, s, node) else {
            continue;
        };
        if util <= limit {
            continue;
        }
        d.avoid_nodes.push(node.clone());
        let Some(pods) = on_node.get(node.as_str()) else {
            continue;
        };
        // The window still holds traffic of the decoders moved last time: wait until it
        // shows the node without them, or every look would move more.
        let cooling = history
            .moved_at
            .get(node)
            .is_some_and(|t| elapsed(*t, now) < settle_seconds(policy));
        if cooling {
            notes.push(format!(
                "node {node} NIC {} > {}: waiting for the last move to show",
                pct(util),
                pct(limit)
            ));
            continue;
        }
        let n = pods.len();
        // Moving shifts the moved decoders' traffic to another node. That helps when decoders
        // share a node (the spread is uneven) or when other traffic fills it; a lone decoder
        // that is the node's traffic, or one that fills the limit on its own, would fill its
        // new node the same: the cure is more decoders (their rate is capped by the NIC).
        let own = decoder_link_share(policy, fleet, s, node, pods).unwrap_or(util);
        let alone = own / n as f64;
        let others = (util - own).max(0.0);
        let hopeless = if alone > limit {
            Some(format!(
                "each of its {n} decoders carries {} alone",
                pct(alone)
            ))
        } else if n == 1 && others <= limit {
            Some(format!(
                "its decoder is most of its traffic (others {})",
                pct(others)
            ))
        } else {
            None
        };
        if let Some(why) = hopeless {
            notes.push(format!(
                "node {node} NIC {} > {}: {why}, moving cannot help",
                pct(util),
                pct(limit),
            ));
            continue;
        }
        d.learned.moved_from.push(node.clone());
        let k = ((n as f64) * (1.0 - limit / util))
            .ceil()
            .clamp(1.0, n as f64) as usize;
        // The last by name: with generated names that is arbitrary but stable between calls.
        moved.extend(pods.iter().rev().take(k).map(|p| p.to_string()));
        notes.push(format!(
            "node {node} NIC {} > {}: moving {k} of {n} decoders",
            pct(util),
            pct(limit)
        ));
    }
    moved.sort();
    d.move_pods = moved;
    notes
}

/// The share of `node`'s link that `pods`, its decoders, fill themselves in the busier
/// direction; `None` without the decoders' byte counters.
fn decoder_link_share(
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    s: &Signals,
    node: &str,
    pods: &[&str],
) -> Option<f64> {
    let per_sample = decoder_bytes_per_sample(s)?;
    let link = link_of(policy, fleet, s, node).filter(|l| *l > 0.0)?;
    let samples: f64 = pods
        .iter()
        .filter_map(|pod| s.decoders.get(*pod))
        .map(|signal| signal.samples_per_second)
        .sum();
    Some(samples * per_sample / link)
}

/// Bytes one sample costs a decoder's NIC in its busier direction (links are full duplex):
/// encoded bytes in from S3 or decoded bytes out to the trainers, with the wire's framing.
/// From the decoders' own counters, which cover the same series as their sample counts.
fn decoder_bytes_per_sample(s: &Signals) -> Option<f64> {
    let busier = f64::max(s.encoded_bytes_per_sample?, s.decoded_bytes_per_sample?);
    (busier > 0.0).then_some(busier * WIRE_OVERHEAD)
}

fn append_notes(reason: &mut String, notes: &[String]) {
    for note in notes {
        reason.push_str("; ");
        reason.push_str(note);
    }
}

/// Trainer nodes whose NIC limits delivery, and the local-decode share that relieves them.
/// The condition lists them while local decode relieves them too; the returned node (the
/// first starving one) blocks scale-up.
#[allow(clippy::too_many_arguments)]
fn trainer_network(
    d: &mut ScaleDecision,
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    s: &Signals,
    history: &ScaleHistory,
    demand: f64,
    consumption: f64,
    starved: bool,
) -> Option<String> {
    let limit = policy.max_nic_utilization;
    let total: u32 = fleet.trainer_nodes.values().sum();
    let previous = history.local_decode_share;
    let mut share: f64 = 0.0;
    let mut saturated = Vec::new();
    let mut relieved = Vec::new();
    for (node, trainers) in &fleet.trainer_nodes {
        let (Some(nic), Some(link)) = (s.nodes.get(node), link_of(policy, fleet, s, node)) else {
            continue;
        };
        let Some(util) = nic.utilization(link) else {
            continue;
        };
        let hot = util > limit && starved;
        if hot {
            saturated.push(node.clone());
        }
        if !hot && previous <= 0.0 {
            continue;
        }
        let part = f64::from(*trainers) / f64::from(total.max(1));
        let node_demand = demand * part;
        let capacity = limit * link;
        let needed = match (s.decoded_bytes_per_sample, s.encoded_bytes_per_sample) {
            (Some(out), Some(inp)) if out > inp && node_demand > 0.0 => {
                (node_demand * out - capacity) / (node_demand * (out - inp))
            }
            // Without the decoders' byte counts: take the bytes per sample the NIC carries now
            // as the network share's, and local decode as nearly free on the wire.
            _ => {
                let delivered = consumption * part;
                if delivered <= 0.0 || node_demand <= 0.0 || previous >= 1.0 {
                    continue;
                }
                let per_sample = nic.receive_bytes_per_second / delivered / (1.0 - previous);
                1.0 - capacity / (node_demand * per_sample)
            }
        };
        if !hot && needed > 0.0 {
            // Relieved by local decode, still the bottleneck without it.
            relieved.push(node.clone());
        }
        share = share.max(needed);
    }
    let mut share = share.clamp(0.0, policy.max_local_decode_share);
    if share < previous && previous - share < LOCAL_SHARE_BAND {
        share = previous;
    }
    d.local_decode_share = share;
    let blocking = saturated.first().cloned();
    saturated.extend(relieved);
    saturated.sort();
    d.conditions.network_saturated = saturated;
    blocking
}

/// How long after a change the window holds only samples from after it: rate() lags by up
/// to a window, and scrapes and evaluation add up to about another.
fn settle_seconds(policy: &AutoscalingPolicy) -> f64 {
    2.0 * policy.window.as_secs_f64()
}

fn elapsed(since: Timestamp, now: Timestamp) -> f64 {
    now.duration_since(since).as_secs_f64()
}

fn ceil_count(x: f64) -> u32 {
    if x.is_finite() && x > 0.0 {
        x.ceil().min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

/// A share as a percentage: one decimal below 10%, none above.
pub fn pct(share: f64) -> String {
    let p = share * 100.0;
    if p.abs() < 10.0 && (p - p.round()).abs() > 0.05 {
        format!("{p:.1}%")
    } else {
        format!("{p:.0}%")
    }
}

/// A rate with thousands separators: 2400.4 → "2,400".
pub fn count(x: f64) -> String {
    if x.is_finite() && x.abs() < 10.0 && (x - x.round()).abs() > 0.05 {
        return format!("{x:.1}");
    }
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::signals::{DecoderSignal, NodeNetwork, gbps_to_bytes_per_second};

    const GPU_NODE: &str = "gpu-1";
    /// 448×448 RGB, and a typical JPEG of it.
    const DECODED: f64 = 602_112.0;
    const ENCODED: f64 = 100_000.0;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("valid time")
    }

    fn pod(i: usize) -> String {
        format!("decoder-{i:02}")
    }

    /// `replicas` decoders spread round-robin over cpu-0..2, `trainers` trainers on gpu-1.
    fn fleet(replicas: u32, trainers: u32) -> DecoderFleet {
        DecoderFleet {
            replicas,
            pods: (0..replicas as usize)
                .map(|i| (pod(i), format!("cpu-{}", i % 3)))
                .collect(),
            trainers,
            trainer_nodes: BTreeMap::from([(GPU_NODE.to_string(), trainers)]),
            node_link_bytes_per_second: BTreeMap::new(),
        }
    }

    /// Every decoder at `busy` of a 210/s full rate; trainers consume what they deliver.
    fn signals(replicas: u32, busy: f64, wait: f64) -> Signals {
        let rate = 210.0 * busy;
        Signals {
            data_wait_share: Some(wait),
            consumption_per_second: Some(rate * f64::from(replicas)),
            trainers_reporting: None,
            gpu_utilization_percent: None,
            decoders: (0..replicas as usize)
                .map(|i| {
                    (
                        pod(i),
                        DecoderSignal {
                            samples_per_second: rate,
                            busy_share: busy,
                        },
                    )
                })
                .collect(),
            nodes: BTreeMap::new(),
            s3_throttles_per_second: Some(0.0),
            s3_requests_per_second: Some(1000.0),
            decoded_bytes_per_sample: Some(DECODED),
            encoded_bytes_per_sample: Some(ENCODED),
        }
    }

    fn nic(util: f64, gbps: f64) -> NodeNetwork {
        let link = gbps_to_bytes_per_second(gbps);
        NodeNetwork {
            receive_bytes_per_second: util * link,
            transmit_bytes_per_second: util * link * 0.1,
            link_bytes_per_second: Some(link),
        }
    }

    /// A history that has seen `signals` for the whole scale-down window.
    fn settled(
        policy: &AutoscalingPolicy,
        fleet: &DecoderFleet,
        signals: &Signals,
    ) -> ScaleHistory {
        let mut h = ScaleHistory::default();
        for t in (-330..0).step_by(30) {
            let mut d = decide(policy, fleet, Some(signals), &h, at(t));
            // Keep the fleet where it is: only the recommendations matter here.
            d.recommended = fleet.replicas;
            h.remember(&d, policy, at(t));
        }
        h
    }

    struct Case {
        name: &'static str,
        policy: AutoscalingPolicy,
        fleet: DecoderFleet,
        signals: Option<Signals>,
        history: ScaleHistory,
        replicas: u32,
        starved: bool,
        network_saturated: &'static [&'static str],
        s3_throttled: bool,
        metrics_unavailable: bool,
        avoid: &'static [&'static str],
        moved: &'static [&'static str],
        reason: &'static str,
    }

    impl Default for Case {
        fn default() -> Self {
            Self {
                name: "",
                policy: policy(),
                fleet: fleet(8, 8),
                signals: Some(signals(8, 1.0, 0.3)),
                history: ScaleHistory::default(),
                replicas: 8,
                starved: false,
                network_saturated: &[],
                s3_throttled: false,
                metrics_unavailable: false,
                avoid: &[],
                moved: &[],
                reason: "",
            }
        }
    }

    fn policy() -> AutoscalingPolicy {
        AutoscalingPolicy {
            min_replicas: 2,
            max_replicas: 64,
            ..AutoscalingPolicy::default()
        }
    }

    fn cases() -> Vec<Case> {
        let p = policy();
        let starving = signals(8, 1.0, 0.3);
        let mut with_gpu = starving.clone();
        with_gpu.gpu_utilization_percent = Some(38.0);
        let mut throttled = starving.clone();
        throttled.s3_throttles_per_second = Some(50.0);
        let mut no_sidecars = starving.clone();
        no_sidecars.data_wait_share = None;
        no_sidecars.consumption_per_second = None;

        let mut hot_decoder_node = signals(6, 0.9, 0.02);
        hot_decoder_node.nodes = BTreeMap::from([
            ("cpu-0".to_string(), nic(0.3, 25.0)),
            ("cpu-1".to_string(), nic(0.95, 25.0)),
            ("cpu-2".to_string(), nic(0.3, 25.0)),
        ]);

        // 16 decoders only 59% busy while the 10 Gb/s trainer NIC runs at 95%.
        let mut hot_trainer_node = signals(16, 0.587, 0.3);
        let delivered = 0.95 * gbps_to_bytes_per_second(10.0) / DECODED;
        hot_trainer_node.consumption_per_second = Some(delivered);
        hot_trainer_node.nodes = BTreeMap::from([(GPU_NODE.to_string(), nic(0.95, 10.0))]);

        let quiet = signals(8, 0.55, 0.01);
        let mut noisy_high = signals(10, 0.85, 0.06);
        noisy_high.consumption_per_second = Some(1785.0);

        let bigger = fleet(16, 16);
        let mut after_growth = ScaleHistory::default();
        after_growth.remember(
            &decide(
                &p,
                &fleet(8, 8),
                Some(&quiet),
                &ScaleHistory::default(),
                at(-30),
            ),
            &p,
            at(-30),
        );
        let mut quiet_throttled = quiet.clone();
        quiet_throttled.s3_throttles_per_second = Some(50.0);
        let mut growth_throttled = ScaleHistory::default();
        growth_throttled.remember(
            &decide(
                &p,
                &fleet(8, 8),
                Some(&quiet),
                &ScaleHistory::default(),
                at(-30),
            ),
            &p,
            at(-30),
        );
        // A decoder rate known from earlier work, before the fleet went to zero.
        let mut after_idle = ScaleHistory::default();
        after_idle.remember(
            &decide(
                &p,
                &fleet(8, 8),
                Some(&quiet),
                &ScaleHistory::default(),
                at(-600),
            ),
            &p,
            at(-600),
        );
        let mut before_shrink = ScaleHistory::default();
        before_shrink.remember(
            &decide(
                &p,
                &fleet(8, 8),
                Some(&quiet),
                &ScaleHistory::default(),
                at(-30),
            ),
            &p,
            at(-30),
        );

        // One decoder behind a saturated 50 Mbit/s NIC, as the story starts: large sources, so
        // the NIC's receive side (encoded bytes in) binds, not the decoded bytes out.
        let nic_bound = |counters: bool| {
            let link = 50e6 / 8.0;
            let (encoded, decoded) = (221_000.0, 150_528.0);
            Signals {
                data_wait_share: Some(0.45),
                consumption_per_second: Some(60.0),
                // 30/s over its own short life; the node's counters span the whole window.
                decoders: BTreeMap::from([(
                    pod(0),
                    DecoderSignal {
                        samples_per_second: 30.0,
                        busy_share: 0.05,
                    },
                )]),
                nodes: BTreeMap::from([(
                    "cpu-0".to_string(),
                    NodeNetwork {
                        receive_bytes_per_second: 0.97 * link,
                        transmit_bytes_per_second: 0.97 * link * decoded / encoded,
                        link_bytes_per_second: Some(link),
                    },
                )]),
                s3_requests_per_second: Some(30.0),
                encoded_bytes_per_sample: counters.then_some(encoded),
                decoded_bytes_per_sample: counters.then_some(decoded),
                ..Signals::default()
            }
        };
        // The same node, but its decoder moves only 2/s: other traffic fills the NIC.
        let mut quiet_nic_bound = nic_bound(true);
        if let Some(decoder) = quiet_nic_bound.decoders.get_mut(&pod(0)) {
            decoder.samples_per_second = 2.0;
        }
        // A lone decoder at 14/s (30% of the link) on a node at 97%: others 67%, under the
        // limit; moving it would only carry its traffic elsewhere.
        let mut busy_lone = nic_bound(true);
        if let Some(decoder) = busy_lone.decoders.get_mut(&pod(0)) {
            decoder.samples_per_second = 8.0;
        }
        let one_decoder = AutoscalingPolicy {
            min_replicas: 1,
            ..policy()
        };

        vec![
            Case {
                name: "starvation: one step to the needed count",
                replicas: 14,
                starved: true,
                reason: "data wait 30% > 5%: need 2,400/s at 210/s per decoder → 14",
                ..Case::default()
            },
            Case {
                name: "starvation with the GPU metric present decides the same",
                signals: Some(with_gpu),
                replicas: 14,
                starved: true,
                reason: "need 2,400/s at 210/s per decoder → 14",
                ..Case::default()
            },
            Case {
                name: "over-provisioned, first look: the scale-down window holds",
                signals: Some(signals(20, 0.238, 0.01)),
                fleet: fleet(20, 8),
                replicas: 20,
                reason: "scale-down window 300s holds 20",
                ..Case::default()
            },
            Case {
                name: "over-provisioned for a whole window: down by the step limit",
                signals: Some(signals(20, 0.238, 0.01)),
                fleet: fleet(20, 8),
                history: settled(&p, &fleet(20, 8), &signals(20, 0.238, 0.01)),
                replicas: 12,
                reason: "need 1,010/s at 210/s per decoder → 6; step limit → 12",
                ..Case::default()
            },
            Case {
                name: "noise above the target inside the band: no change",
                signals: Some(noisy_high),
                fleet: fleet(10, 8),
                replicas: 10,
                starved: true,
                reason: "within the 10% band of 10",
                ..Case::default()
            },
            Case {
                name: "noise below the target inside the band: no change",
                signals: Some(signals(10, 0.7, 0.01)),
                fleet: fleet(10, 8),
                history: settled(&p, &fleet(10, 8), &signals(10, 0.7, 0.01)),
                replicas: 10,
                reason: "within the 10% band of 10",
                ..Case::default()
            },
            Case {
                name: "a decoder node's NIC above the limit: avoid it, move decoders off",
                signals: Some(hot_decoder_node),
                fleet: fleet(6, 8),
                replicas: 6,
                avoid: &["cpu-1"],
                moved: &["decoder-04"],
                reason: "node cpu-1 NIC 95% > 80%: moving 1 of 2 decoders",
                ..Case::default()
            },
            Case {
                name: "NIC-bound decoder: its rate is what the busier direction carries",
                policy: one_decoder.clone(),
                fleet: fleet(1, 1),
                signals: Some(nic_bound(true)),
                replicas: 7,
                starved: true,
                avoid: &["cpu-0"],
                reason: "need 109/s at 22/s per decoder → 7; node cpu-0 NIC 97% > 80%: each of its 1 decoders carries 111% alone, moving cannot help",
                ..Case::default()
            },
            Case {
                name: "a lone decoder on a node others fill: moved off",
                policy: one_decoder.clone(),
                fleet: fleet(1, 1),
                signals: Some(quiet_nic_bound),
                replicas: 7,
                starved: true,
                avoid: &["cpu-0"],
                moved: &["decoder-00"],
                reason: "node cpu-0 NIC 97% > 80%: moving 1 of 1 decoders",
                ..Case::default()
            },
            Case {
                name: "a lone decoder that is most of its node's traffic: not moved",
                policy: one_decoder.clone(),
                fleet: fleet(1, 1),
                signals: Some(busy_lone),
                replicas: 7,
                starved: true,
                avoid: &["cpu-0"],
                reason: "node cpu-0 NIC 97% > 80%: its decoder is most of its traffic (others 67%), moving cannot help",
                ..Case::default()
            },
            Case {
                name: "NIC-bound decoder without byte counters: the node's busier direction",
                policy: one_decoder,
                fleet: fleet(1, 1),
                signals: Some(nic_bound(false)),
                replicas: 6,
                starved: true,
                avoid: &["cpu-0"],
                reason: "need 109/s at 25/s per decoder → 6",
                ..Case::default()
            },
            Case {
                name: "the trainer node's NIC is the bottleneck: no scale-up, local decode",
                signals: Some(hot_trainer_node),
                fleet: fleet(16, 8),
                replicas: 16,
                starved: true,
                network_saturated: &[GPU_NODE],
                avoid: &[GPU_NODE],
                reason: "trainer node gpu-1 NIC above 80%: more decoders cannot help; local decode 49%",
                ..Case::default()
            },
            Case {
                name: "S3 throttling: no scale-up",
                signals: Some(throttled),
                replicas: 8,
                starved: true,
                s3_throttled: true,
                reason: "S3 throttles 5% of requests > 1%: not scaling up",
                ..Case::default()
            },
            Case {
                name: "Prometheus unreachable: keep the size",
                signals: None,
                replicas: 8,
                metrics_unavailable: true,
                reason: "Prometheus unreachable: keeping 8 decoders",
                ..Case::default()
            },
            Case {
                name: "no sidecar series: keep the size",
                signals: Some(no_sidecars),
                replicas: 8,
                metrics_unavailable: true,
                reason: "no data-wait or delivery series from 8 trainers",
                ..Case::default()
            },
            Case {
                name: "trainers 8 → 16: follow demand before any starvation",
                signals: Some(quiet.clone()),
                fleet: fleet(8, 16),
                history: after_growth,
                replicas: 11,
                reason: "trainers 8 → 16: need 1,867/s at 210/s per decoder → 11",
                ..Case::default()
            },
            Case {
                name: "trainers 16 → 8: follow without the scale-down window",
                signals: Some(signals(16, 0.55, 0.01)),
                fleet: DecoderFleet {
                    trainers: 4,
                    trainer_nodes: BTreeMap::from([(GPU_NODE.to_string(), 4)]),
                    ..bigger
                },
                history: before_shrink,
                replicas: 8,
                reason: "trainers 8 → 4: need 467/s at 210/s per decoder → 3; step limit → 8",
                ..Case::default()
            },
            Case {
                name: "starved with no decoders: one step up",
                policy: AutoscalingPolicy {
                    min_replicas: 0,
                    ..policy()
                },
                fleet: fleet(0, 8),
                signals: Some(Signals {
                    data_wait_share: Some(1.0),
                    consumption_per_second: Some(0.0),
                    ..Signals::default()
                }),
                history: after_idle,
                replicas: 8,
                starved: true,
                reason: "data wait 100% > 5% with no decoders → 8",
                ..Case::default()
            },
            Case {
                name: "more trainers while S3 throttles: no scale-up",
                signals: Some(quiet_throttled),
                fleet: fleet(8, 16),
                history: growth_throttled,
                replicas: 8,
                s3_throttled: true,
                reason: "S3 throttles 5% of requests > 1%: not scaling up",
                ..Case::default()
            },
            Case {
                name: "demand beyond maxReplicas",
                policy: AutoscalingPolicy {
                    max_replicas: 12,
                    ..policy()
                },
                replicas: 12,
                starved: true,
                reason: "→ 14; maxReplicas 12",
                ..Case::default()
            },
            Case {
                name: "no trainers: minReplicas once the window agrees",
                fleet: fleet(4, 0),
                signals: Some(Signals::default()),
                history: settled(&p, &fleet(4, 0), &Signals::default()),
                replicas: 2,
                reason: "no trainers: 2 decoders",
                ..Case::default()
            },
            Case {
                name: "recommend mode: the fleet keeps minReplicas",
                policy: AutoscalingPolicy {
                    mode: AutoscalingMode::Recommend,
                    ..policy()
                },
                replicas: 2,
                starved: true,
                reason: "recommend only: data wait 30% > 5%",
                ..Case::default()
            },
            Case {
                name: "off: the fixed count",
                policy: AutoscalingPolicy {
                    mode: AutoscalingMode::Off,
                    fixed_replicas: Some(5),
                    ..policy()
                },
                replicas: 5,
                reason: "autoscaling off: 5 decoders",
                ..Case::default()
            },
        ]
    }

    #[test]
    fn policy_table() {
        for case in cases() {
            let d = decide(
                &case.policy,
                &case.fleet,
                case.signals.as_ref(),
                &case.history,
                at(0),
            );
            let name = case.name;
            assert_eq!(d.replicas, case.replicas, "{name}: {}", d.reason);
            assert_eq!(
                d.conditions.starved, case.starved,
                "{name}: starved; {}",
                d.reason
            );
            assert_eq!(
                d.conditions.network_saturated, case.network_saturated,
                "{name}"
            );
            assert_eq!(
                d.conditions.s3_throttled, case.s3_throttled,
                "{name}: {}",
                d.reason
            );
            assert_eq!(
                d.conditions.metrics_unavailable, case.metrics_unavailable,
                "{name}"
            );
            assert_eq!(d.avoid_nodes, case.avoid, "{name}");
            assert_eq!(d.move_pods, case.moved, "{name}");
            assert!(
                d.reason.contains(case.reason),
                "{name}: reason {:?}",
                d.reason
            );
        }
    }

    #[test]
    fn missing_gpu_metric_is_not_an_error() {
        let d = decide(
            &policy(),
            &fleet(8, 8),
            Some(&signals(8, 1.0, 0.3)),
            &ScaleHistory::default(),
            at(0),
        );
        assert!(!d.conditions.metrics_unavailable);
        assert_eq!(d.observed.gpu_utilization_percent, None);
        assert_eq!(d.observed.data_wait_percent, Some(30.0));
    }

    #[test]
    fn local_decode_share_relieves_the_trainer_nic_to_its_limit() {
        let mut s = signals(16, 0.587, 0.3);
        let link = gbps_to_bytes_per_second(10.0);
        s.consumption_per_second = Some(0.95 * link / DECODED);
        s.nodes = BTreeMap::from([(GPU_NODE.to_string(), nic(0.95, 10.0))]);
        let d = decide(
            &policy(),
            &fleet(16, 8),
            Some(&s),
            &ScaleHistory::default(),
            at(0),
        );
        let demand = 0.95 * link / DECODED / 0.7;
        let wire =
            demand * ((1.0 - d.local_decode_share) * DECODED + d.local_decode_share * ENCODED);
        assert!(
            (wire / link - 0.8).abs() < 0.01,
            "NIC after the shift: {}",
            wire / link
        );
    }

    #[test]
    fn an_outage_restarts_the_scale_down_window() {
        let p = policy();
        let f = fleet(20, 8);
        let over = signals(20, 0.238, 0.01);
        let mut h = settled(&p, &f, &over);
        let d = decide(&p, &f, None, &h, at(0));
        h.remember(&d, &p, at(0));
        let d = decide(&p, &f, Some(&over), &h, at(30));
        assert_eq!(d.replicas, 20, "{}", d.reason);
    }

    #[test]
    fn reasons_read_as_numbers() {
        assert_eq!(count(2400.4), "2,400");
        assert_eq!(count(1_234_567.0), "1,234,567");
        assert_eq!(count(210.0), "210");
        assert_eq!(pct(0.22), "22%");
        assert_eq!(pct(0.018), "1.8%");
        assert_eq!(pct(0.05), "5%");
    }
}
