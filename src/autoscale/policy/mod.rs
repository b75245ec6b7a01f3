//! The scaling policy: signals and the fleet as it is → a [`ScaleDecision`]. Pure: no clock,
//! no I/O; the caller passes `now` and keeps the [`ScaleHistory`].
//!
//! [`decide`] is a sequence of steps, one file a question:
//! - `demand.rs`: how many decoders the trainers need (required rate ÷ per-decoder rate ×
//!   headroom);
//! - `nic.rs`: what the NICs allow (utilization, link speeds, the per-decoder rate cap, the
//!   local-decode share that relieves a saturated trainer node);
//! - `s3.rs`: whether S3 throttling holds the fleet where it is;
//! - `placement.rs`: which nodes new decoders avoid, which decoders move;
//! - `recommend.rs`: the count the readings add up to, and why;
//! - `windows.rs`: the tolerance band, stabilization windows, step limits and bounds;
//! - `mode.rs`: the count the fleet runs in each mode ([`decoder_count`]), decided there only;
//! - `reason.rs`: how the reasons write numbers.

mod demand;
mod mode;
mod nic;
mod placement;
mod recommend;
mod s3;
mod windows;

pub mod reason;

#[cfg(test)]
mod testing;

use std::collections::{BTreeMap, VecDeque};
use std::ops::RangeInclusive;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::api::v1alpha1::{Autoscaling, AutoscalingMode, DataPipelineSpec, Decoders};

use super::signals::Signals;

pub use mode::{DecoderCount, decoder_count};
pub use placement::keep_off;
pub use reason::{count, pct};

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

/// The knobs the CRD does not carry: operator-wide (flags, chart values), the same for every
/// pipeline.
struct OperatorKnobs {
    headroom: f64,
    tolerance: f64,
    max_s3_throttle_share: f64,
    max_local_decode_share: f64,
    window: Duration,
    default_link_bytes_per_second: Option<f64>,
}

impl Default for OperatorKnobs {
    fn default() -> Self {
        Self {
            headroom: 1.2,
            tolerance: 0.1,
            max_s3_throttle_share: 0.01,
            max_local_decode_share: 0.5,
            window: Duration::from_secs(60),
            default_link_bytes_per_second: None,
        }
    }
}

impl OperatorKnobs {
    fn of(policy: &AutoscalingPolicy) -> Self {
        Self {
            headroom: policy.headroom,
            tolerance: policy.tolerance,
            max_s3_throttle_share: policy.max_s3_throttle_share,
            max_local_decode_share: policy.max_local_decode_share,
            window: policy.window,
            default_link_bytes_per_second: policy.default_link_bytes_per_second,
        }
    }
}

/// The CRD's own defaults (one place: its serde defaults) and the operator's for the rest.
impl Default for AutoscalingPolicy {
    fn default() -> Self {
        Self::from_crd(
            &Autoscaling::default(),
            &Decoders::default(),
            OperatorKnobs::default(),
        )
    }
}

impl AutoscalingPolicy {
    /// The policy a `DataPipeline` asks for. Knobs the CRD does not carry yet (headroom,
    /// tolerance, window, S3 throttle limit, local-decode cap, default link speed) keep their
    /// defaults.
    pub fn from_spec(spec: &DataPipelineSpec) -> Self {
        Self::from_spec_over(spec, &Self::default())
    }

    /// The spec's fields over operator-wide `defaults` for the knobs the CRD does not carry.
    pub fn from_spec_over(spec: &DataPipelineSpec, defaults: &AutoscalingPolicy) -> Self {
        Self::from_crd(
            &spec.autoscaling,
            &spec.decoders,
            OperatorKnobs::of(defaults),
        )
    }

    fn from_crd(a: &Autoscaling, d: &Decoders, knobs: OperatorKnobs) -> Self {
        let count = |n: i32| u32::try_from(n).unwrap_or(0);
        let seconds = |n: i32| Duration::from_secs(u64::try_from(n).unwrap_or(0));
        Self {
            mode: a.mode,
            min_replicas: count(d.min_replicas),
            max_replicas: count(d.max_replicas),
            fixed_replicas: a.replicas.map(count),
            target_data_wait: f64::from(a.target_data_wait_percent) / 100.0,
            max_nic_utilization: f64::from(a.max_nic_utilization_percent) / 100.0,
            scale_up_stabilization: seconds(a.scale_up_stabilization_seconds),
            scale_down_stabilization: seconds(a.scale_down_stabilization_seconds),
            max_scale_up_step: count(a.max_scale_up_step).max(1),
            max_scale_down_step: count(a.max_scale_down_step).max(1),
            headroom: knobs.headroom,
            tolerance: knobs.tolerance,
            max_s3_throttle_share: knobs.max_s3_throttle_share,
            max_local_decode_share: knobs.max_local_decode_share,
            window: knobs.window,
            default_link_bytes_per_second: knobs.default_link_bytes_per_second,
        }
    }

    /// minReplicas..=maxReplicas; a maxReplicas below minReplicas counts as minReplicas.
    pub fn replica_range(&self) -> RangeInclusive<u32> {
        self.min_replicas..=self.max_replicas.max(self.min_replicas)
    }

    /// `n` within [`Self::replica_range`].
    pub fn bound(&self, n: u32) -> u32 {
        let range = self.replica_range();
        n.clamp(*range.start(), *range.end())
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
    /// Nodes the last decision keeps new decoders off, until the next one.
    avoid_nodes: Vec<String>,
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
            .is_some_and(|(t, _)| windows::elapsed(*t, now) > keep.as_secs_f64())
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
        placement::remember_moves(&mut self.moved_at, decision, policy, now);
        self.trainers = Some(decision.learned.trainers);
        self.local_decode_share = decision.local_decode_share;
        self.last_recommended = Some(decision.recommended);
        self.decided_at = Some(now);
        self.avoid_nodes.clone_from(&decision.avoid_nodes);
    }

    /// When the last decision was made.
    pub fn decided_at(&self) -> Option<Timestamp> {
        self.decided_at
    }

    /// The last recommendation, the fleet size in recommend mode.
    pub fn last_recommended(&self) -> Option<u32> {
        self.last_recommended
    }

    /// Nodes new decoders must not land on, from the last decision.
    pub fn avoid_nodes(&self) -> &[String] {
        &self.avoid_nodes
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

    /// A decision that keeps `current` (within bounds) until a step says otherwise.
    fn start(
        policy: &AutoscalingPolicy,
        fleet: &DecoderFleet,
        history: &ScaleHistory,
        current: u32,
    ) -> Self {
        Self {
            from: fleet.replicas,
            recommended: policy.bound(current),
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
        }
    }
}

/// Decides the decoder count and placement for one pipeline.
pub fn decide(
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    signals: Option<&Signals>,
    history: &ScaleHistory,
    now: Timestamp,
) -> ScaleDecision {
    // In recommend mode the fleet does not follow: the decision builds on the last one.
    let current = match policy.mode {
        AutoscalingMode::Recommend => history.last_recommended.unwrap_or(fleet.replicas),
        _ => fleet.replicas,
    };
    let d = ScaleDecision::start(policy, fleet, history, current);
    if policy.mode == AutoscalingMode::Off {
        return mode::fixed(policy, d);
    }
    let Some(signals) = signals else {
        let reason = format!("Prometheus unreachable: keeping {} decoders", d.recommended);
        return unmeasured(policy, d, reason);
    };
    let snapshot = Snapshot {
        policy,
        fleet,
        signals,
        history,
        now,
    };
    decide_on(&snapshot, d, current)
}

/// The pipeline as one decision sees it, once Prometheus answered.
struct Snapshot<'a> {
    policy: &'a AutoscalingPolicy,
    fleet: &'a DecoderFleet,
    signals: &'a Signals,
    history: &'a ScaleHistory,
    now: Timestamp,
}

/// [`decide`] once Prometheus answered: placement, demand, the readings, the recommendation,
/// then the band and the windows.
fn decide_on(snap: &Snapshot<'_>, mut d: ScaleDecision, current: u32) -> ScaleDecision {
    let (policy, fleet) = (snap.policy, snap.fleet);
    observe(&mut d, snap);
    let placement = placement::place(&mut d, snap);
    if fleet.trainers == 0 {
        let min = policy.min_replicas;
        d.local_decode_share = 0.0;
        d.learned.recommendation = Some(min);
        d.reason = format!("no trainers: {min} decoders (minReplicas)");
        reason::append_notes(&mut d.reason, &placement);
        return windows::stabilize(snap, d, current, min, false);
    }
    let Some(demand) = demand::demand(&mut d, snap) else {
        let reason = format!(
            "no data-wait or delivery series from {} trainers: keeping {} decoders",
            fleet.trainers, d.recommended
        );
        return unmeasured(policy, d, reason);
    };
    let reading = read(&mut d, snap, demand);
    let raw = recommend::recommend(&mut d, snap, current, &reading);
    reason::append_notes(&mut d.reason, &placement);
    let following = reading.demand.following;
    let raw = windows::tolerate(&mut d, policy, current, raw, following);
    d.learned.recommendation = Some(raw);
    // A drop that follows trainers that left is not a measurement that may be noise.
    let trainers_left = following && reading.demand.trainers_before > fleet.trainers;
    windows::stabilize(snap, d, current, raw, trainers_left)
}

/// Nothing to measure the demand by: keep the size, and say so (`MetricsUnavailable`).
fn unmeasured(policy: &AutoscalingPolicy, mut d: ScaleDecision, reason: String) -> ScaleDecision {
    d.conditions.metrics_unavailable = true;
    d.reason = reason;
    mode::finish(policy, d)
}

/// What the recommendation weighs, each reading in the order the next one needs it.
fn read(d: &mut ScaleDecision, snap: &Snapshot<'_>, demand: demand::Demand) -> recommend::Reading {
    let rate = demand::decoder_rate(d, snap);
    let throttle = s3::throttle(snap.policy, snap.signals);
    d.conditions.s3_throttled = throttle.held;
    let saturated = nic::trainer_network(d, snap, &demand);
    let need = demand::need(d, snap.policy, &demand, &rate);
    recommend::Reading {
        demand,
        rate,
        need,
        throttle,
        saturated,
    }
}

/// `status.observed`: the signals as they came, and the hottest NIC of the pipeline's nodes.
fn observe(d: &mut ScaleDecision, snap: &Snapshot<'_>) {
    let s = snap.signals;
    d.observed.data_wait_percent = s.data_wait_share.map(|w| w * 100.0);
    d.observed.gpu_utilization_percent = s.gpu_utilization_percent;
    d.observed.samples_per_second = s.consumption_per_second;
    d.observed.s3_throttles_per_second = s.s3_throttles_per_second;
    // The pipeline's own nodes: Prometheus answers for every node of the cluster.
    d.observed.max_nic_utilization_percent = snap
        .fleet
        .pods
        .values()
        .chain(snap.fleet.trainer_nodes.keys())
        .filter_map(|n| snap.nic_utilization(n))
        .reduce(f64::max)
        .map(|u| u * 100.0);
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn without_measurements_the_size_is_kept() {
        let mut no_sidecars = signals(8, 1.0, 0.3);
        no_sidecars.data_wait_share = None;
        no_sidecars.consumption_per_second = None;
        check(vec![
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
                name: "no trainers: minReplicas once the window agrees",
                fleet: fleet(4, 0),
                signals: Some(Signals::default()),
                history: settled(&policy(), &fleet(4, 0), &Signals::default()),
                replicas: 2,
                reason: "no trainers: 2 decoders",
                ..Case::default()
            },
        ]);
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
    fn the_defaults_are_the_crds() {
        // A pipeline that says nothing of decoders or autoscaling gets the policy's defaults.
        let mut dp: serde_yaml::Value = serde_yaml::from_str(include_str!(
            "../../../tests/fixtures/datapipeline-crop.yaml"
        ))
        .expect("fixture");
        let spec = dp["spec"].as_mapping_mut().expect("a spec");
        spec.remove("decoders");
        spec.remove("autoscaling");
        let dp: crate::api::DataPipeline = serde_yaml::from_value(dp).expect("still a pipeline");
        assert_eq!(
            AutoscalingPolicy::from_spec(&dp.spec),
            AutoscalingPolicy::default()
        );
    }
}
