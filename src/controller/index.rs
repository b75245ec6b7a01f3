//! The dataset index of a `webDataset` pipeline: the index Job is created once per
//! (shards, index location, reindex annotation); its progress, and once it finished the summary
//! its pod left as termination message, become `status.index` and the `IndexReady` condition.
//! Sidecars cannot plan before the index exists, so `Ready` waits for it.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};

use super::status::{DEGRADED, READY, set_condition};
use crate::api::DataPipeline;
use crate::api::v1alpha1::{DataPipelineStatus, IndexStatus};

pub const INDEX_READY: &str = "IndexReady";
pub const BUILDING: &str = "Building";
pub const READY_PHASE: &str = "Ready";
pub const FAILED: &str = "Failed";

/// A pipeline's index Jobs and their pods, as the observe step read them.
#[derive(Clone, Debug, Default)]
pub struct IndexObserved {
    /// The Jobs the pipeline owns (the one desired, and any a source change left behind).
    pub jobs: Vec<Job>,
    /// The pods of those Jobs (label `stoker.dev/index-of`).
    pub pods: Vec<Pod>,
}

/// The label the Job controller puts on a Job's pods.
const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";

/// `status.index` for the desired `job`: kept as it was once settled for this Job, else from
/// the Job as observed and, when it has finished, its pods' termination messages.
pub fn status_of(dp: &DataPipeline, job: &Job, observed: &IndexObserved) -> IndexStatus {
    let name = job.name_any();
    let previous = dp.status.as_ref().and_then(|s| s.index.clone());
    if let Some(p) = previous.filter(|p| p.job == name && p.phase != BUILDING) {
        return p;
    }
    let location = dp
        .spec
        .source
        .indexed()
        .map(|d| d.index.to_string())
        .unwrap_or_default();
    let live = observed.jobs.iter().find(|j| j.name_any() == name);
    let Some(succeeded) = live.and_then(finished) else {
        return IndexStatus {
            job: name,
            phase: BUILDING.to_string(),
            location,
            ..IndexStatus::default()
        };
    };
    let pods: Vec<Pod> = observed
        .pods
        .iter()
        .filter(|p| p.labels().get(JOB_NAME_LABEL) == Some(&name))
        .cloned()
        .collect();
    from_pods(name, location, succeeded, &pods)
}

/// `Some(true)` once the Job completed, `Some(false)` once it failed, `None` while it runs.
fn finished(job: &Job) -> Option<bool> {
    let conditions = job.status.as_ref()?.conditions.as_ref()?;
    let holds = |t: &str| {
        conditions
            .iter()
            .any(|c| c.type_ == t && c.status == "True")
    };
    if holds("Complete") {
        Some(true)
    } else if holds("Failed") {
        Some(false)
    } else {
        None
    }
}

/// The settled status of a finished Job from its pods: the summary of the pod that succeeded,
/// or the last words of one that failed.
pub fn from_pods(job: String, location: String, succeeded: bool, pods: &[Pod]) -> IndexStatus {
    let phase = if succeeded { "Succeeded" } else { "Failed" };
    let message = pods
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some(phase))
        .find_map(termination_message);
    let mut status = IndexStatus {
        job,
        phase: if succeeded { READY_PHASE } else { FAILED }.to_string(),
        location,
        ..IndexStatus::default()
    };
    if !succeeded {
        status.message = Some(
            message
                .map(|m| {
                    m.chars()
                        .rev()
                        .take(1024)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect()
                })
                .unwrap_or_else(|| "the index Job failed; see its pods' logs".to_string()),
        );
        return status;
    }
    let summary = message.and_then(|m| serde_json::from_str::<serde_json::Value>(m.trim()).ok());
    let Some(summary) = summary else {
        status.message = Some("the index Job finished without a summary".to_string());
        return status;
    };
    let figure = |k: &str| summary.get(k).and_then(serde_json::Value::as_i64);
    status.shards = figure("shards");
    status.samples = figure("samples");
    status.shard_bytes = figure("shardBytes");
    status.offsets_bytes = figure("offsetsBytes");
    status.problems = figure("problems");
    status
}

fn termination_message(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
}

/// Puts the index into the status: `IndexReady`, and `Ready=False` until the index is built.
pub fn report(
    dp: &DataPipeline,
    status: &mut DataPipelineStatus,
    index: IndexStatus,
    now: Timestamp,
) {
    let generation = dp.meta().generation;
    let (ready, reason, message) = match index.phase.as_str() {
        READY_PHASE => (
            "True",
            "IndexBuilt",
            match (index.samples, index.shards) {
                (Some(samples), Some(shards)) => {
                    format!("{samples} samples in {shards} shards at {}", index.location)
                }
                _ => format!("built at {}", index.location),
            },
        ),
        FAILED => (
            "False",
            "IndexFailed",
            index.message.clone().unwrap_or_default(),
        ),
        _ => (
            "False",
            "IndexBuilding",
            format!("Job {} is building the index", index.job),
        ),
    };
    set_condition(
        &mut status.conditions,
        INDEX_READY,
        ready,
        reason,
        message.clone(),
        generation,
        now,
    );
    if ready != "True" {
        set_condition(
            &mut status.conditions,
            READY,
            "False",
            reason,
            message.clone(),
            generation,
            now,
        );
    }
    if index.phase == FAILED {
        set_condition(
            &mut status.conditions,
            DEGRADED,
            "True",
            reason,
            message,
            generation,
            now,
        );
    }
    status.index = Some(index);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../examples/webdataset.yaml")).expect("example")
    }

    fn pod(phase: &str, message: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {
                "phase": phase,
                "containerStatuses": [{
                    "name": "index", "image": "i", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "message": message}},
                }],
            },
        }))
        .expect("pod")
    }

    fn condition<'a>(s: &'a DataPipelineStatus, t: &str) -> (&'a str, &'a str) {
        let c = s.conditions.iter().find(|c| c.type_ == t).expect(t);
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn a_finished_job_reports_the_summary_its_pod_left() {
        let summary = r#"{"index":"s3://laion-index/v1/","shards":4096,"samples":41000000,"shardBytes":9000000000,"offsetsBytes":328032768,"problems":2,"seconds":812.5}"#;
        let pods = [pod("Failed", "throttled"), pod("Succeeded", summary)];
        let index = from_pods("j".into(), "s3://laion-index/v1/".into(), true, &pods);
        assert_eq!(index.phase, READY_PHASE);
        assert_eq!(index.samples, Some(41_000_000));
        assert_eq!(index.shards, Some(4096));
        assert_eq!(index.offsets_bytes, Some(328_032_768));
        assert_eq!(index.problems, Some(2));
        let mut status = DataPipelineStatus::default();
        report(&dp(), &mut status, index, Timestamp::now());
        assert_eq!(condition(&status, INDEX_READY), ("True", "IndexBuilt"));
        assert!(
            status.conditions[0]
                .message
                .contains("41000000 samples in 4096 shards")
        );
    }

    #[test]
    fn a_running_or_failed_index_keeps_the_pipeline_from_ready() {
        let building = IndexStatus {
            job: "j".into(),
            phase: BUILDING.into(),
            ..IndexStatus::default()
        };
        let mut status = DataPipelineStatus::default();
        set_condition(
            &mut status.conditions,
            READY,
            "True",
            "DecodersReady",
            String::new(),
            None,
            Timestamp::now(),
        );
        report(&dp(), &mut status, building, Timestamp::now());
        assert_eq!(condition(&status, READY), ("False", "IndexBuilding"));

        let failed = from_pods(
            "j".into(),
            "s3://x/".into(),
            false,
            &[pod(
                "Failed",
                "AccessDenied on s3://laion-index/v1/index.json",
            )],
        );
        assert_eq!(failed.phase, FAILED);
        report(&dp(), &mut status, failed, Timestamp::now());
        assert_eq!(condition(&status, INDEX_READY), ("False", "IndexFailed"));
        assert_eq!(condition(&status, DEGRADED), ("True", "IndexFailed"));
        assert!(
            status
                .index
                .expect("index")
                .message
                .expect("why")
                .contains("AccessDenied")
        );
    }

    #[test]
    fn no_summary_is_said_rather_than_made_up() {
        let index = from_pods("j".into(), "s3://x/".into(), true, &[pod("Succeeded", "")]);
        assert_eq!(index.phase, READY_PHASE);
        assert_eq!(index.samples, None);
        assert!(index.message.expect("why").contains("without a summary"));
    }

    #[test]
    fn the_status_is_read_from_the_desired_job_and_its_own_pods() {
        let dp = dp();
        let job = crate::build::index_job::index_job(&dp, &crate::build::BuildDefaults::default())
            .expect("builds")
            .expect("an index Job");
        let name = job.name_any();
        let labelled = |job: &str, phase: &str, message: &str| {
            let mut p = pod(phase, message);
            p.metadata.labels = Some([(JOB_NAME_LABEL.to_string(), job.to_string())].into());
            p
        };
        let nothing = IndexObserved::default();
        assert_eq!(status_of(&dp, &job, &nothing).phase, BUILDING);
        let mut complete = job.clone();
        complete.status = serde_json::from_value(serde_json::json!({
            "conditions": [{"type": "Complete", "status": "True"}],
        }))
        .expect("status");
        let observed = IndexObserved {
            jobs: vec![complete],
            pods: vec![
                labelled("an-old-job", "Succeeded", r#"{"samples":1}"#),
                labelled(&name, "Succeeded", r#"{"samples":7,"shards":1}"#),
            ],
        };
        let index = status_of(&dp, &job, &observed);
        assert_eq!(
            (index.phase.as_str(), index.samples),
            (READY_PHASE, Some(7))
        );
    }
}
