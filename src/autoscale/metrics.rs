//! The autoscaler's own metrics: every input signal it decided on, and desired vs current
//! decoders, per pipeline. Dashboards show why a decision was made from these alone.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::policy::ScaleDecision;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PipelineLabels {
    pub namespace: String,
    pub pipeline: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    pub namespace: String,
    pub pipeline: String,
    pub condition: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    pub namespace: String,
    pub pipeline: String,
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabels {
    pub category: &'static str,
}

type Ratio = Gauge<f64, AtomicU64>;

/// Registered under the registry the operator passes (its `stoker_` prefix, then `autoscaler_`).
#[derive(Debug, Clone, Default)]
pub struct AutoscalerMetrics {
    current: Family<PipelineLabels, Gauge>,
    desired: Family<PipelineLabels, Gauge>,
    recommended: Family<PipelineLabels, Gauge>,
    needed: Family<PipelineLabels, Gauge>,
    data_wait: Family<PipelineLabels, Ratio>,
    consumption: Family<PipelineLabels, Ratio>,
    gpu_utilization: Family<PipelineLabels, Ratio>,
    decoder_rate: Family<PipelineLabels, Ratio>,
    decoder_busy: Family<PipelineLabels, Ratio>,
    max_nic_utilization: Family<PipelineLabels, Ratio>,
    s3_throttles: Family<PipelineLabels, Ratio>,
    local_decode_share: Family<PipelineLabels, Ratio>,
    conditions: Family<ConditionLabels, Gauge>,
    decisions: Family<DirectionLabels, Counter>,
    signal_errors: Family<CategoryLabels, Counter>,
}

impl AutoscalerMetrics {
    /// Creates the metrics and registers them in `registry` under `autoscaler_`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("autoscaler");
        r.register(
            "current_decoders",
            "Decoders the fleet ran when the autoscaler decided",
            m.current.clone(),
        );
        r.register(
            "desired_decoders",
            "Decoders the autoscaler asks the fleet to run",
            m.desired.clone(),
        );
        r.register(
            "recommended_decoders",
            "Decoders the policy recommends (differs from desired in recommend mode)",
            m.recommended.clone(),
        );
        r.register(
            "needed_decoders",
            "Decoders the demand needs in one step, before stabilization, step limits and bounds",
            m.needed.clone(),
        );
        r.register(
            "data_wait_percent",
            "Share of wall time the trainers waited for data, as read: the second most starved rank's, so that one stuck rank does not count",
            m.data_wait.clone(),
        );
        r.register(
            "consumption_samples_per_second",
            "Samples per second the sidecars delivered to trainers, as read",
            m.consumption.clone(),
        );
        r.register(
            "gpu_utilization_percent",
            "Mean GPU utilization of the trainers (absent without dcgm-exporter)",
            m.gpu_utilization.clone(),
        );
        r.register(
            "decoder_samples_per_second",
            "Measured rate of one fully busy decoder",
            m.decoder_rate.clone(),
        );
        r.register(
            "decoder_busy_percent",
            "Mean busy share of the decoders",
            m.decoder_busy.clone(),
        );
        r.register(
            "max_nic_utilization_percent",
            "Highest NIC utilization among the pipeline's nodes",
            m.max_nic_utilization.clone(),
        );
        r.register(
            "s3_throttles_per_second",
            "S3 throttle answers per second across the decoders",
            m.s3_throttles.clone(),
        );
        r.register(
            "local_decode_share",
            "Share of the work the sidecars decode themselves",
            m.local_decode_share.clone(),
        );
        r.register(
            "condition",
            "1 when the autoscaler's condition holds for the pipeline",
            m.conditions.clone(),
        );
        r.register(
            "decisions",
            "Decisions by direction (up, down, hold)",
            m.decisions.clone(),
        );
        r.register(
            "signal_errors",
            "Failed reads of Prometheus by error category",
            m.signal_errors.clone(),
        );
        m
    }

    /// Records one decision and the signals behind it. Signals that were absent are removed,
    /// so that a stale value is never shown as current.
    pub fn record(&self, namespace: &str, pipeline: &str, d: &ScaleDecision) {
        let l = PipelineLabels {
            namespace: namespace.to_string(),
            pipeline: pipeline.to_string(),
        };
        self.current.get_or_create(&l).set(i64::from(d.from));
        self.desired.get_or_create(&l).set(i64::from(d.replicas));
        self.recommended
            .get_or_create(&l)
            .set(i64::from(d.recommended));
        set_or_remove(&self.needed, &l, d.needed.map(i64::from));
        let o = &d.observed;
        set_ratio(&self.data_wait, &l, o.data_wait_percent);
        set_ratio(&self.consumption, &l, o.samples_per_second);
        set_ratio(&self.gpu_utilization, &l, o.gpu_utilization_percent);
        set_ratio(&self.decoder_rate, &l, o.decoder_samples_per_second);
        set_ratio(&self.decoder_busy, &l, o.decoder_busy_percent);
        set_ratio(&self.max_nic_utilization, &l, o.max_nic_utilization_percent);
        set_ratio(&self.s3_throttles, &l, o.s3_throttles_per_second);
        self.local_decode_share
            .get_or_create(&l)
            .set(d.local_decode_share);
        let c = &d.conditions;
        for (condition, holds) in [
            ("Starved", c.starved),
            ("NetworkSaturated", !c.network_saturated.is_empty()),
            ("S3Throttled", c.s3_throttled),
            ("MetricsUnavailable", c.metrics_unavailable),
        ] {
            let labels = ConditionLabels {
                namespace: namespace.to_string(),
                pipeline: pipeline.to_string(),
                condition,
            };
            self.conditions.get_or_create(&labels).set(i64::from(holds));
        }
        let direction = match d.replicas.cmp(&d.from) {
            std::cmp::Ordering::Greater => "up",
            std::cmp::Ordering::Less => "down",
            std::cmp::Ordering::Equal => "hold",
        };
        self.decisions
            .get_or_create(&DirectionLabels {
                namespace: namespace.to_string(),
                pipeline: pipeline.to_string(),
                direction,
            })
            .inc();
    }

    pub fn signal_error(&self, category: &'static str) {
        self.signal_errors
            .get_or_create(&CategoryLabels { category })
            .inc();
    }

    /// Removes a deleted pipeline's series.
    pub fn forget(&self, namespace: &str, pipeline: &str) {
        let l = PipelineLabels {
            namespace: namespace.to_string(),
            pipeline: pipeline.to_string(),
        };
        for f in [
            &self.current,
            &self.desired,
            &self.recommended,
            &self.needed,
        ] {
            f.remove(&l);
        }
        for f in [
            &self.data_wait,
            &self.consumption,
            &self.gpu_utilization,
            &self.decoder_rate,
            &self.decoder_busy,
            &self.max_nic_utilization,
            &self.s3_throttles,
            &self.local_decode_share,
        ] {
            f.remove(&l);
        }
        for condition in [
            "Starved",
            "NetworkSaturated",
            "S3Throttled",
            "MetricsUnavailable",
        ] {
            self.conditions.remove(&ConditionLabels {
                namespace: namespace.to_string(),
                pipeline: pipeline.to_string(),
                condition,
            });
        }
        for direction in ["up", "down", "hold"] {
            self.decisions.remove(&DirectionLabels {
                namespace: namespace.to_string(),
                pipeline: pipeline.to_string(),
                direction,
            });
        }
    }
}

fn set_or_remove(f: &Family<PipelineLabels, Gauge>, l: &PipelineLabels, v: Option<i64>) {
    match v {
        Some(v) => {
            f.get_or_create(l).set(v);
        }
        None => {
            f.remove(l);
        }
    }
}

fn set_ratio(f: &Family<PipelineLabels, Ratio>, l: &PipelineLabels, v: Option<f64>) {
    match v {
        Some(v) => {
            f.get_or_create(l).set(v);
        }
        None => {
            f.remove(l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::policy::{AutoscalingPolicy, DecoderFleet, ScaleHistory, decide};
    use crate::autoscale::signals::Signals;
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn a_decision_shows_up_with_its_signals() {
        let mut registry = Registry::with_prefix("stoker");
        let m = AutoscalerMetrics::register(&mut registry);
        let fleet = DecoderFleet {
            replicas: 2,
            trainers: 1,
            ..DecoderFleet::default()
        };
        let signals = Signals {
            data_wait_share: Some(0.22),
            consumption_per_second: Some(100.0),
            ..Signals::default()
        };
        let d = decide(
            &AutoscalingPolicy::default(),
            &fleet,
            Some(&signals),
            &ScaleHistory::default(),
            Timestamp::UNIX_EPOCH,
        );
        m.record("training", "qwen", &d);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        assert!(
            text.contains(
                r#"stoker_autoscaler_data_wait_percent{namespace="training",pipeline="qwen"} 22"#
            ),
            "{text}"
        );
        assert!(text.contains(
            r#"stoker_autoscaler_current_decoders{namespace="training",pipeline="qwen"} 2"#
        ));
        assert!(text.contains(r#"stoker_autoscaler_condition{namespace="training",pipeline="qwen",condition="Starved"} 1"#));
        assert!(
            !text.contains("stoker_autoscaler_gpu_utilization_percent{"),
            "absent GPU metric is not exported"
        );
        m.forget("training", "qwen");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        assert!(!text.contains(r#"pipeline="qwen""#));
    }
}
