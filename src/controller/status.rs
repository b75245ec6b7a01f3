//! Status: computed purely from what was observed ([`super::report`] writes it, only when it
//! changed).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Resource;

use crate::api::DataPipeline;
use crate::api::v1alpha1::{
    AutoscalingMode, DataPipelineStatus, DecoderFleetStatus, ScaleRecord, TrainerStatus,
};

pub const READY: &str = "Ready";
pub const DEGRADED: &str = "Degraded";
/// True while the pipeline's sidecars report that S3 refuses its samples (their Events).
pub const SOURCE_UNAVAILABLE: &str = "SourceUnavailable";
/// The autoscaler's conditions; it reports Unknown until it has read signals.
pub const AUTOSCALER_CONDITIONS: [&str; 4] = [
    "Starved",
    "NetworkSaturated",
    "S3Throttled",
    "MetricsUnavailable",
];

/// Sets a condition, keeping its transition time when the status did not change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) {
    let previous = conditions.iter().position(|c| c.type_ == type_);
    let last_transition_time = previous
        .map(|i| &conditions[i])
        .filter(|c| c.status == status)
        .map_or(Time(now), |c| c.last_transition_time.clone());
    let condition = Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time,
    };
    match previous {
        Some(i) => conditions[i] = condition,
        None => conditions.push(condition),
    }
}

/// What one reconcile saw and did, the inputs of the status.
pub struct Observation<'a> {
    pub fleet: DecoderFleetStatus,
    pub trainers: TrainerStatus,
    pub problems: Vec<String>,
    pub failed_replaced: usize,
    /// A sidecar's recent report that the source refuses the samples.
    pub source_outage: Option<String>,
    pub scale_reason: String,
    /// The autoscaler's decision, when this reconcile made one.
    pub autoscale: Option<&'a crate::autoscale::ScaleDecision>,
}

/// A condition's status, reason and message.
type Said = (&'static str, &'static str, String);

/// `Ready`: the decoders are, or why not.
fn ready(obs: &Observation) -> Said {
    let fleet = &obs.fleet;
    if !obs.problems.is_empty() {
        ("False", "InvalidSpec", obs.problems.join("; "))
    } else if fleet.ready >= fleet.desired {
        let nodes = fleet.nodes;
        let message = format!(
            "{}/{} decoders ready on {nodes} nodes",
            fleet.ready, fleet.desired
        );
        ("True", "DecodersReady", message)
    } else {
        let message = format!("{}/{} decoders ready", fleet.ready, fleet.desired);
        ("False", "DecodersStarting", message)
    }
}

/// `Degraded`: what went wrong that the operator saw.
fn degraded(obs: &Observation) -> Said {
    if !obs.problems.is_empty() {
        ("True", "InvalidSpec", obs.problems.join("; "))
    } else if obs.failed_replaced > 0 {
        let message = format!("{} failed decoder pods were replaced", obs.failed_replaced);
        ("True", "DecodersFailed", message)
    } else {
        ("False", "AsExpected", "no problems seen".to_string())
    }
}

/// `SourceUnavailable`: what the sidecars report.
fn source_unavailable(obs: &Observation) -> Said {
    match &obs.source_outage {
        Some(note) => ("True", "SidecarsReport", note.clone()),
        None => {
            let message = "no sidecar reports S3 refusing samples".to_string();
            ("False", "Readable", message)
        }
    }
}

/// The status the pipeline should have now.
pub fn desired_status(dp: &DataPipeline, obs: Observation, now: Timestamp) -> DataPipelineStatus {
    let previous = dp.status.clone().unwrap_or_default();
    let generation = dp.meta().generation;
    let mut conditions = previous.conditions.clone();
    let mut set = |type_: &str, (status, reason, message): Said| {
        set_condition(
            &mut conditions,
            type_,
            status,
            reason,
            message,
            generation,
            now,
        );
    };
    set(READY, ready(&obs));
    set(DEGRADED, degraded(&obs));
    set(SOURCE_UNAVAILABLE, source_unavailable(&obs));
    for c in obs.autoscale.iter().flat_map(|d| d.condition_reports()) {
        set_condition(
            &mut conditions,
            c.type_,
            c.status,
            c.reason,
            c.message,
            generation,
            now,
        );
    }
    unknown_autoscaler_conditions(dp, &mut conditions, now);
    let fleet = obs.fleet;
    let last_scale = match previous.last_scale.clone() {
        _ if previous.decoders.desired != fleet.desired && dp.status.is_some() => {
            Some(ScaleRecord {
                time: Time(now),
                from: previous.decoders.desired,
                to: fleet.desired,
                reason: obs.scale_reason,
            })
        }
        kept => kept,
    };
    DataPipelineStatus {
        observed_generation: generation,
        conditions,
        decoders: fleet,
        trainers: obs.trainers,
        observed: obs
            .autoscale
            .map(|d| d.observed_signals())
            .or(previous.observed),
        last_scale,
        // The reconcile reports the index (see `super::index`); kept while the source has one.
        index: previous
            .index
            .filter(|_| dp.spec.source.indexed().is_some()),
        // Replaced by the reconcile when it writes a new certificate.
        certificate: previous.certificate,
    }
}

/// The status after a failed reconcile: `Degraded=True` with the failure's reason and message;
/// the rest stays as last written, since nothing new was observed.
pub fn failed_status(
    dp: &DataPipeline,
    reason: &str,
    message: &str,
    now: Timestamp,
) -> DataPipelineStatus {
    let mut status = dp.status.clone().unwrap_or_default();
    set_condition(
        &mut status.conditions,
        DEGRADED,
        "True",
        reason,
        message.chars().take(32 * 1024).collect(),
        dp.meta().generation,
        now,
    );
    status
}

/// The autoscaler's conditions nobody has set yet (all of them when it is off): `Unknown`.
fn unknown_autoscaler_conditions(
    dp: &DataPipeline,
    conditions: &mut Vec<Condition>,
    now: Timestamp,
) {
    let off = dp.spec.autoscaling.mode == AutoscalingMode::Off;
    let (reason, message) = match off {
        true => ("AutoscalingFixed", "autoscaling.mode is fixed"),
        false => ("NoSignals", "the autoscaler has not read any signals yet"),
    };
    for t in AUTOSCALER_CONDITIONS {
        // Keep what the autoscaler wrote; only fill in conditions nobody has set.
        if off || !conditions.iter().any(|c| c.type_ == t) {
            let generation = dp.meta().generation;
            set_condition(
                conditions,
                t,
                "Unknown",
                reason,
                message.to_string(),
                generation,
                now,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::v1alpha1::DecoderFleetStatus;

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    fn obs(desired: i32, ready: i32) -> Observation<'static> {
        Observation {
            fleet: DecoderFleetStatus {
                desired,
                ready,
                draining: 0,
                nodes: ready,
            },
            trainers: TrainerStatus::default(),
            problems: vec![],
            failed_replaced: 0,
            source_outage: None,
            scale_reason: "decoders.minReplicas".into(),
            autoscale: None,
        }
    }

    fn condition<'a>(s: &'a DataPipelineStatus, t: &str) -> &'a Condition {
        s.conditions
            .iter()
            .find(|c| c.type_ == t)
            .expect("condition")
    }

    #[test]
    fn ready_when_every_desired_decoder_is_ready() {
        let t0 = Timestamp::from_second(1_800_000_000).expect("ts");
        let mut p = dp();
        let s = desired_status(&p, obs(4, 2), t0);
        assert_eq!(condition(&s, READY).status, "False");
        assert_eq!(condition(&s, READY).message, "2/4 decoders ready");
        assert_eq!(condition(&s, DEGRADED).status, "False");
        for t in AUTOSCALER_CONDITIONS {
            assert_eq!(condition(&s, t).status, "Unknown");
        }
        p.status = Some(s);
        let t1 = Timestamp::from_second(1_800_000_060).expect("ts");
        let s = desired_status(&p, obs(4, 4), t1);
        assert_eq!(condition(&s, READY).status, "True");
        assert_eq!(condition(&s, READY).last_transition_time, Time(t1));
        // Unchanged conditions keep their transition time, so the status is written only once.
        assert_eq!(condition(&s, DEGRADED).last_transition_time, Time(t0));
        p.status = Some(s.clone());
        let again = desired_status(&p, obs(4, 4), t1 + std::time::Duration::from_secs(60));
        assert_eq!(again, s);
    }

    #[test]
    fn a_change_of_desired_is_recorded_as_last_scale() {
        let mut p = dp();
        let t0 = Timestamp::from_second(1_800_000_000).expect("ts");
        p.status = Some(desired_status(&p, obs(4, 4), t0));
        let s = desired_status(&p, obs(6, 4), t0);
        let last = s.last_scale.expect("lastScale");
        assert_eq!(
            (last.from, last.to, last.reason.as_str()),
            (4, 6, "decoders.minReplicas")
        );
    }

    #[test]
    fn a_failed_reconcile_is_degraded_with_its_reason() {
        let t0 = Timestamp::from_second(1_800_000_000).expect("ts");
        let mut p = dp();
        p.status = Some(desired_status(&p, obs(2, 2), t0));
        let t1 = Timestamp::from_second(1_800_000_060).expect("ts");
        let s = failed_status(&p, "Forbidden", "create Pod ns/dp: exceeded quota", t1);
        let degraded = condition(&s, DEGRADED);
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", "Forbidden")
        );
        assert_eq!(degraded.message, "create Pod ns/dp: exceeded quota");
        assert_eq!(degraded.last_transition_time, Time(t1));
        // What was observed before stays; so does Ready.
        assert_eq!(condition(&s, READY).status, "True");
        assert_eq!(s.decoders.desired, 2);
        // The same failure again changes nothing, so the status is not written again.
        p.status = Some(s.clone());
        let t2 = Timestamp::from_second(1_800_000_120).expect("ts");
        assert_eq!(
            failed_status(&p, "Forbidden", "create Pod ns/dp: exceeded quota", t2),
            s
        );
    }

    #[test]
    fn invalid_spec_is_degraded_and_not_ready() {
        let mut o = obs(4, 4);
        o.problems = vec!["decoders.image is empty".into()];
        let s = desired_status(&dp(), o, Timestamp::from_second(1_800_000_000).expect("ts"));
        assert_eq!(condition(&s, READY).reason, "InvalidSpec");
        assert_eq!(condition(&s, DEGRADED).status, "True");
    }
}
