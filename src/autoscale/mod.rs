//! The decoder autoscaler. Per pipeline and period: read [`Signals`] from Prometheus
//! (`prometheus.rs`, in the background through [`cache::SignalCache`], never inside a
//! reconcile), decide with the pure [`policy`], remember the decision in a [`ScaleHistory`] for
//! the stabilization windows, and export what it saw (`metrics.rs`). The controller's
//! `autoscaling.rs` is only the adapter that asks the cache, decides on a fresh snapshot and
//! tells the sidecars their local-decode share.
//!
//! Per reconcile of a pipeline in `auto` or `recommend` mode:
//! ```text
//! let fleet = DecoderFleet::observe(in_effect, &decoders, &trainers, world_size);
//! cache.ask(&key, fleet.scope(&namespace, &name, &trainers, window), &client); // never waits
//! if let Latest::Fresh(snapshot) = cache.take(&key, Instant::now()) {          // once per read
//!     fleet.node_link_bytes_per_second = snapshot.node_links?;    // Err: no decision, Degraded
//!     let decision = autoscaler.step_pipeline(&dp, &defaults, &fleet, snapshot.signals.ok(), now);
//!     metrics.record(&namespace, &name, &decision);
//! }
//! ```
//! and on every reconcile, `decoder_count(&dp.spec, decision, in_effect)` is the count the fleet
//! runs (and why); new decoders go through `keep_off(pod, autoscaler.avoid_nodes(key))`,
//! `decision.move_pods` drain and are replaced, `decision.local_decode_share` goes to the
//! sidecars, and `decision.condition_reports()`, `decision.observed_signals()` and the reason
//! (`status.lastScale`, an Event) go into the status.

pub mod metrics;
pub mod policy;
pub mod signals;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use crate::api::v1alpha1::ObservedSignals;
use crate::api::{DataPipeline, PipelineKey};

pub use policy::{
    AutoscalingPolicy, DecoderCount, DecoderFleet, ScaleConditions, ScaleDecision, ScaleHistory,
    decide, decoder_count, keep_off,
};
pub use signals::{DecoderSignal, NodeNetwork, SignalScope, Signals};

/// A node's link speed in gigabits per second, for nodes whose node-exporter reports none.
pub const ANNOTATION_NIC_GBPS: &str = "stoker.dev/nic-gbps";

impl DecoderFleet {
    /// The fleet as the controller observed it: `replicas` is the count in effect
    /// (`status.decoders.desired`), `world_size` the trainers' declared world size. Pods that
    /// are terminating or not yet scheduled have no node and place nothing. The nodes' link
    /// speeds come later, from the background read ([`cache::link_speeds`]).
    pub fn observe(replicas: u32, decoders: &[Pod], trainers: &[Pod], world_size: u32) -> Self {
        let node_of = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone());
        let live = |p: &&Pod| p.metadata.deletion_timestamp.is_none();
        let mut trainer_nodes: BTreeMap<String, u32> = BTreeMap::new();
        for node in trainers.iter().filter(live).filter_map(node_of) {
            *trainer_nodes.entry(node).or_default() += 1;
        }
        Self {
            replicas,
            pods: decoders
                .iter()
                .filter(live)
                .filter_map(|p| Some((p.metadata.name.clone()?, node_of(p)?)))
                .collect(),
            trainers: world_size,
            trainer_nodes,
            node_link_bytes_per_second: BTreeMap::new(),
        }
    }

    /// What to ask Prometheus about this fleet.
    pub fn scope(
        &self,
        pipeline: &PipelineKey,
        trainer_pods: &[Pod],
        window: Duration,
    ) -> SignalScope {
        let mut nodes: Vec<String> = self
            .pods
            .values()
            .chain(self.trainer_nodes.keys())
            .cloned()
            .collect();
        nodes.sort();
        nodes.dedup();
        SignalScope {
            namespace: pipeline.namespace.clone(),
            pipeline: pipeline.name.clone(),
            trainer_pods: trainer_pods
                .iter()
                .filter_map(|p| p.metadata.name.clone())
                .collect(),
            nodes,
            window,
        }
    }
}

/// The autoscaler's memory of every pipeline it decides for.
#[derive(Debug, Default)]
pub struct Autoscaler {
    pipelines: BTreeMap<PipelineKey, ScaleHistory>,
}

impl Autoscaler {
    /// Decides for one pipeline and remembers the decision. `signals` is `None` when
    /// Prometheus could not be read: the decision keeps the size and says so.
    pub fn step(
        &mut self,
        pipeline: &PipelineKey,
        policy: &AutoscalingPolicy,
        fleet: &DecoderFleet,
        signals: Option<&Signals>,
        now: Timestamp,
    ) -> ScaleDecision {
        let history = self.pipelines.entry(pipeline.clone()).or_default();
        let decision = decide(policy, fleet, signals, history, now);
        history.remember(&decision, policy, now);
        decision
    }

    /// [`Autoscaler::step`] with the policy the pipeline's spec asks for over the
    /// operator-wide `defaults`.
    pub fn step_pipeline(
        &mut self,
        dp: &DataPipeline,
        defaults: &AutoscalingPolicy,
        fleet: &DecoderFleet,
        signals: Option<&Signals>,
        now: Timestamp,
    ) -> ScaleDecision {
        let policy = AutoscalingPolicy::from_spec_over(&dp.spec, defaults);
        self.step(&PipelineKey::of(dp), &policy, fleet, signals, now)
    }

    /// Whether a pipeline is due for a decision: reconciles come with every pod event, but
    /// Prometheus is read once per `period` (a new window holds new information only so often).
    pub fn due(&self, pipeline: &PipelineKey, now: Timestamp, period: Duration) -> bool {
        self.pipelines
            .get(pipeline)
            .and_then(ScaleHistory::decided_at)
            .is_none_or(|t| now.duration_since(t).as_secs_f64() >= period.as_secs_f64())
    }

    /// Nodes new decoders of `pipeline` must not land on, from its latest decision.
    pub fn avoid_nodes(&self, pipeline: &PipelineKey) -> Vec<String> {
        self.pipelines
            .get(pipeline)
            .map(|h| h.avoid_nodes().to_vec())
            .unwrap_or_default()
    }

    /// Drops a deleted pipeline's history.
    pub fn forget(&mut self, pipeline: &PipelineKey) {
        self.pipelines.remove(pipeline);
    }

    pub fn history(&self, pipeline: &PipelineKey) -> Option<&ScaleHistory> {
        self.pipelines.get(pipeline)
    }
}

/// One of the autoscaler's status conditions, ready for the controller's `set_condition`.
#[derive(Clone, Debug, PartialEq)]
pub struct ConditionReport {
    pub type_: &'static str,
    /// "True", "False" or "Unknown".
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl ScaleDecision {
    /// Starved, NetworkSaturated, S3Throttled and MetricsUnavailable for this decision.
    /// Without signals only MetricsUnavailable is known.
    pub fn condition_reports(&self) -> Vec<ConditionReport> {
        let c = &self.conditions;
        let report = |type_, status, reason, message: String| ConditionReport {
            type_,
            status,
            reason,
            message,
        };
        if c.metrics_unavailable {
            let unknown =
                |type_| report(type_, "Unknown", "MetricsUnavailable", self.reason.clone());
            return vec![
                unknown("Starved"),
                unknown("NetworkSaturated"),
                unknown("S3Throttled"),
                report(
                    "MetricsUnavailable",
                    "True",
                    "SignalsMissing",
                    self.reason.clone(),
                ),
            ];
        }
        let wait = self
            .observed
            .data_wait_percent
            .map_or_else(|| "unknown".to_string(), |w| format!("{w:.1}%"));
        vec![
            if c.starved {
                report(
                    "Starved",
                    "True",
                    "DataWaitAboveTarget",
                    self.reason.clone(),
                )
            } else {
                report(
                    "Starved",
                    "False",
                    "DataWaitWithinTarget",
                    format!("data wait {wait}"),
                )
            },
            if c.network_saturated.is_empty() {
                report(
                    "NetworkSaturated",
                    "False",
                    "NicWithinLimit",
                    "no trainer node's NIC limits delivery".into(),
                )
            } else {
                report(
                    "NetworkSaturated",
                    "True",
                    "TrainerNicSaturated",
                    format!(
                        "NIC of trainer node {} limits delivery; sidecars decode {} locally",
                        c.network_saturated.join(", "),
                        policy::pct(self.local_decode_share)
                    ),
                )
            },
            if c.s3_throttled {
                report("S3Throttled", "True", "SlowDown", self.reason.clone())
            } else {
                report(
                    "S3Throttled",
                    "False",
                    "NotThrottled",
                    "S3 throttles within the limit".into(),
                )
            },
            report(
                "MetricsUnavailable",
                "False",
                "SignalsRead",
                "signals read from Prometheus".into(),
            ),
        ]
    }

    /// `status.observed`.
    pub fn observed_signals(&self) -> ObservedSignals {
        ObservedSignals {
            data_wait_percent: self.observed.data_wait_percent,
            gpu_utilization_percent: self.observed.gpu_utilization_percent,
            samples_per_second: self.observed.samples_per_second,
            max_nic_utilization_percent: self.observed.max_nic_utilization_percent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, node: Option<&str>) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": name },
            "spec": { "containers": [], "nodeName": node },
        }))
        .expect("pod")
    }

    #[test]
    fn the_fleet_is_read_from_pods() {
        let decoders = [
            pod("d-1", Some("cpu-1")),
            pod("d-2", Some("cpu-2")),
            pod("d-3", None),
        ];
        let trainers = [
            pod("t-0", Some("gpu-1")),
            pod("t-1", Some("gpu-1")),
            pod("t-2", Some("gpu-2")),
        ];
        let f = DecoderFleet::observe(3, &decoders, &trainers, 3);
        assert_eq!(f.replicas, 3);
        assert_eq!(f.pods.len(), 2, "an unscheduled decoder places nothing");
        assert_eq!(
            f.trainer_nodes,
            BTreeMap::from([("gpu-1".into(), 2), ("gpu-2".into(), 1)])
        );
        let scope = f.scope(
            &PipelineKey::new("training", "qwen"),
            &trainers,
            Duration::from_secs(60),
        );
        assert_eq!(scope.nodes, ["cpu-1", "cpu-2", "gpu-1", "gpu-2"]);
        assert_eq!(scope.trainer_pods, ["t-0", "t-1", "t-2"]);
    }

    #[test]
    fn the_policy_follows_the_spec() {
        let dp: crate::api::DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        let p = AutoscalingPolicy::from_spec(&dp.spec);
        assert_eq!((p.min_replicas, p.max_replicas), (4, 64));
        assert!((p.target_data_wait - 0.05).abs() < 1e-12);
        assert!((p.max_nic_utilization - 0.80).abs() < 1e-12);
        assert_eq!(p.scale_down_stabilization, Duration::from_secs(300));

        let mut autoscaler = Autoscaler::default();
        let fleet = DecoderFleet {
            replicas: 1,
            ..DecoderFleet::default()
        };
        let d = autoscaler.step_pipeline(
            &dp,
            &AutoscalingPolicy::default(),
            &fleet,
            None,
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(
            d.replicas, 4,
            "minReplicas 4 bounds even a kept size: {}",
            d.reason
        );
        assert!(
            autoscaler
                .history(&PipelineKey::new("training", "qwen3vl-pretrain"))
                .is_some()
        );
        let period = Duration::from_secs(30);
        let later = |s: i64| Timestamp::from_second(s).expect("valid time");
        assert!(!autoscaler.due(
            &PipelineKey::new("training", "qwen3vl-pretrain"),
            later(29),
            period
        ));
        assert!(autoscaler.due(
            &PipelineKey::new("training", "qwen3vl-pretrain"),
            later(30),
            period
        ));
        assert!(autoscaler.due(&PipelineKey::new("training", "other"), later(0), period));
    }

    #[test]
    fn new_decoders_avoid_what_the_last_decision_found_hot() {
        let key = &PipelineKey::new("training", "qwen");
        let link = signals::gbps_to_bytes_per_second(10.0);
        let fleet = DecoderFleet {
            replicas: 1,
            pods: BTreeMap::from([("d-0".into(), "cpu-0".into())]),
            ..DecoderFleet::default()
        };
        let hot = Signals {
            nodes: BTreeMap::from([(
                "cpu-0".into(),
                NodeNetwork {
                    receive_bytes_per_second: 0.95 * link,
                    transmit_bytes_per_second: 0.0,
                    link_bytes_per_second: Some(link),
                },
            )]),
            ..Signals::default()
        };
        let policy = AutoscalingPolicy::default();
        let mut autoscaler = Autoscaler::default();
        let at = |s: i64| Timestamp::from_second(s).expect("valid time");
        autoscaler.step(key, &policy, &fleet, Some(&hot), at(0));
        assert_eq!(autoscaler.avoid_nodes(key), ["cpu-0"]);
        autoscaler.step(key, &policy, &fleet, Some(&Signals::default()), at(30));
        assert!(
            autoscaler.avoid_nodes(key).is_empty(),
            "the next decision decides anew"
        );
        autoscaler.step(key, &policy, &fleet, Some(&hot), at(60));
        autoscaler.forget(key);
        assert!(autoscaler.avoid_nodes(key).is_empty());
    }

    #[test]
    fn conditions_say_why() {
        let d = Autoscaler::default().step(
            &PipelineKey::new("training", "qwen"),
            &AutoscalingPolicy::default(),
            &DecoderFleet {
                replicas: 3,
                trainers: 2,
                ..DecoderFleet::default()
            },
            None,
            Timestamp::UNIX_EPOCH,
        );
        let reports = d.condition_reports();
        let types: Vec<&str> = reports.iter().map(|c| c.type_).collect();
        assert_eq!(
            types,
            [
                "Starved",
                "NetworkSaturated",
                "S3Throttled",
                "MetricsUnavailable"
            ]
        );
        assert_eq!(reports[3].status, "True");
        assert!(
            reports[3]
                .message
                .contains("Prometheus unreachable: keeping 3 decoders")
        );
        assert!(reports[..3].iter().all(|c| c.status == "Unknown"));
    }
}
