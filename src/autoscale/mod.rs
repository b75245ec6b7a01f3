//! The decoder autoscaler. Per pipeline and period: read [`Signals`] from Prometheus
//! (`prometheus.rs`, the only I/O here), decide with the pure [`policy`], remember the decision
//! in a [`ScaleHistory`] for the stabilization windows, and export what it saw (`metrics.rs`).
//!
//! The controller calls, per reconcile of an autoscaled pipeline:
//! ```text
//! let policy = AutoscalingPolicy::from_spec(&dp.spec);
//! let signals = prometheus.read(&scope).await;          // Err → None: keep the size
//! let decision = autoscaler.step(&key, &policy, &fleet, signals.as_ref().ok(), now);
//! let desired = fleet::desired_replicas(&dp.spec, Some(decision.recommended as i32));
//! ```
//! and places new decoders off `decision.avoid_nodes`, drains `decision.move_pods`, writes
//! `decision.condition_reports()` and `decision.reason` into the status.

pub mod metrics;
pub mod policy;
pub mod prometheus;
pub mod signals;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::api::v1alpha1::{DataPipelineSpec, ObservedSignals};

pub use policy::{
    AutoscalingPolicy, DecoderFleet, ScaleConditions, ScaleDecision, ScaleHistory, decide,
};
pub use signals::{DecoderSignal, NodeNetwork, Signals};

impl AutoscalingPolicy {
    /// The policy a `DataPipeline` asks for. Knobs the CRD does not carry yet (headroom,
    /// tolerance, window, S3 throttle limit, local-decode cap, default link speed) keep their
    /// defaults.
    pub fn from_spec(spec: &DataPipelineSpec) -> Self {
        let a = &spec.autoscaling;
        let d = &spec.decoders;
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
            ..Self::default()
        }
    }
}

/// The autoscaler's memory of every pipeline it decides for, keyed by `namespace/name`.
#[derive(Debug, Default)]
pub struct Autoscaler {
    pipelines: BTreeMap<String, ScaleHistory>,
}

impl Autoscaler {
    /// Decides for one pipeline and remembers the decision. `signals` is `None` when
    /// Prometheus could not be read: the decision keeps the size and says so.
    pub fn step(
        &mut self,
        pipeline: &str,
        policy: &AutoscalingPolicy,
        fleet: &DecoderFleet,
        signals: Option<&Signals>,
        now: Timestamp,
    ) -> ScaleDecision {
        let history = self.pipelines.entry(pipeline.to_string()).or_default();
        let decision = decide(policy, fleet, signals, history, now);
        history.remember(&decision, policy, now);
        decision
    }

    /// Drops a deleted pipeline's history.
    pub fn forget(&mut self, pipeline: &str) {
        self.pipelines.remove(pipeline);
    }

    pub fn history(&self, pipeline: &str) -> Option<&ScaleHistory> {
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
