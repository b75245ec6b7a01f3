//! What the policy's tests share: a fleet, its signals, histories, and a table of cases each
//! checked against one decision.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;

pub(super) use crate::autoscale::signals::{DecoderSignal, NodeNetwork, gbps_to_bytes_per_second};

use super::{AutoscalingPolicy, DecoderFleet, ScaleHistory, Signals, decide};

pub(super) const GPU_NODE: &str = "gpu-1";
/// 448×448 RGB, and a typical JPEG of it.
pub(super) const DECODED: f64 = 602_112.0;
pub(super) const ENCODED: f64 = 100_000.0;

pub(super) fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).expect("valid time")
}

pub(super) fn pod(i: usize) -> String {
    format!("decoder-{i:02}")
}

/// `replicas` decoders spread round-robin over cpu-0..2, `trainers` trainers on gpu-1.
pub(super) fn fleet(replicas: u32, trainers: u32) -> DecoderFleet {
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
pub(super) fn signals(replicas: u32, busy: f64, wait: f64) -> Signals {
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

pub(super) fn nic(util: f64, gbps: f64) -> NodeNetwork {
    let link = gbps_to_bytes_per_second(gbps);
    NodeNetwork {
        receive_bytes_per_second: util * link,
        transmit_bytes_per_second: util * link * 0.1,
        link_bytes_per_second: Some(link),
    }
}

/// One decoder behind a saturated 50 Mbit/s NIC, as the story starts: large sources, so the
/// NIC's receive side (encoded bytes in) binds, not the decoded bytes out. `counters`: whether
/// the decoders export their byte counts.
pub(super) fn nic_bound(counters: bool) -> Signals {
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
}

/// A history that has seen `signals` for the whole scale-down window.
pub(super) fn settled(
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

/// Decoders at 55% and trainers barely waiting: 8 of each, each decoder's rate known.
pub(super) fn quiet() -> Signals {
    signals(8, 0.55, 0.01)
}

/// A history of one decision on [`quiet`], `secs` seconds from now.
pub(super) fn after_quiet(secs: i64) -> ScaleHistory {
    let p = policy();
    let mut h = ScaleHistory::default();
    h.remember(
        &decide(
            &p,
            &fleet(8, 8),
            Some(&quiet()),
            &ScaleHistory::default(),
            at(secs),
        ),
        &p,
        at(secs),
    );
    h
}

pub(super) fn policy() -> AutoscalingPolicy {
    AutoscalingPolicy {
        min_replicas: 2,
        max_replicas: 64,
        ..AutoscalingPolicy::default()
    }
}

/// [`policy`] that may go down to one decoder.
pub(super) fn one_decoder() -> AutoscalingPolicy {
    AutoscalingPolicy {
        min_replicas: 1,
        ..policy()
    }
}

/// One row of a policy table: the inputs of a decision and what it must say.
pub(super) struct Case {
    pub name: &'static str,
    pub policy: AutoscalingPolicy,
    pub fleet: DecoderFleet,
    pub signals: Option<Signals>,
    pub history: ScaleHistory,
    pub replicas: u32,
    pub starved: bool,
    pub network_saturated: &'static [&'static str],
    pub s3_throttled: bool,
    pub metrics_unavailable: bool,
    pub avoid: &'static [&'static str],
    pub moved: &'static [&'static str],
    /// A part of the reason.
    pub reason: &'static str,
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

/// Decides each case at one moment and checks all it must say.
pub(super) fn check(cases: Vec<Case>) {
    for case in cases {
        let d = decide(
            &case.policy,
            &case.fleet,
            case.signals.as_ref(),
            &case.history,
            at(0),
        );
        let name = case.name;
        let why = format!("{name}: {}", d.reason);
        assert_eq!(d.replicas, case.replicas, "{why}");
        assert_eq!(d.conditions.starved, case.starved, "{why}: starved");
        assert_eq!(
            d.conditions.network_saturated, case.network_saturated,
            "{why}"
        );
        assert_eq!(d.conditions.s3_throttled, case.s3_throttled, "{why}");
        assert_eq!(
            d.conditions.metrics_unavailable, case.metrics_unavailable,
            "{why}"
        );
        assert_eq!(d.avoid_nodes, case.avoid, "{why}");
        assert_eq!(d.move_pods, case.moved, "{why}");
        assert!(
            d.reason.contains(case.reason),
            "{name}: reason {:?}",
            d.reason
        );
    }
}
