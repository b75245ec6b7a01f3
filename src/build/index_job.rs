//! The Job that builds a WebDataset or Parquet pipeline's dataset index: `stoker-loader index` from the
//! loader image, once per (shards, index location, `stoker.dev/reindex` annotation). Its name
//! carries a hash of those, so a pipeline gets a new Job exactly when one of them changes and a
//! finished Job is never run again by a resync or an operator restart.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, PodSpec, PodTemplateSpec, ResourceRequirements, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use sha2::{Digest, Sha256};
use stoker_contract::RenderError;

use super::decoder_pod::{credentials_env_from, instance_metadata_env};
use super::loader_args::{TERMINATION_LOG, index_args};
use super::{BuildDefaults, LOADER_COMMAND, child_meta, restricted_security_context};
use crate::api::DataPipeline;
use crate::api::v1alpha1::IndexedDataset;

/// Set (or change) this annotation on a pipeline to build its index again, e.g. after shards
/// were added: `kubectl annotate dp NAME stoker.dev/reindex="$(date +%s)" --overwrite`.
pub const ANNOTATION_REINDEX: &str = "stoker.dev/reindex";

const CONTAINER: &str = "index";

/// The label on an index Job's pod naming its pipeline.
pub const LABEL_INDEX_OF: &str = "stoker.dev/index-of";

/// Tries before the Job fails (S3 errors are already retried inside each try).
const BACKOFF_LIMIT: i32 = 3;

/// The index Job `dp` should have: `None` unless it reads WebDataset shards or Parquet files.
pub fn index_job(dp: &DataPipeline, defaults: &BuildDefaults) -> Result<Option<Job>, RenderError> {
    let (Some(dataset), Some(args)) = (dp.spec.source.indexed(), index_args(dp)?) else {
        return Ok(None);
    };
    let container = Container {
        name: CONTAINER.to_string(),
        image: Some(defaults.loader_image(dp)),
        command: Some(vec![LOADER_COMMAND.to_string()]),
        args: Some(args),
        env: Some(instance_metadata_env(dp).into_iter().collect()),
        env_from: credentials_env_from(dp),
        // Reading tar headers is I/O; the offset table grows by 8 bytes a sample.
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("500m".into())),
                ("memory".to_string(), Quantity("256Mi".into())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity("1Gi".into()),
            )])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(restricted_security_context()),
        volume_mounts: Some(vec![VolumeMount {
            name: "tmp".to_string(),
            mount_path: "/tmp".to_string(),
            ..VolumeMount::default()
        }]),
        termination_message_path: Some(TERMINATION_LOG.to_string()),
        // A failed run's message is the end of its log: the error, for the pipeline's status.
        termination_message_policy: Some("FallbackToLogsOnError".to_string()),
        ..Container::default()
    };
    let d = &dp.spec.decoders;
    // Not the pipeline label: the webhook injects a sidecar into pods that carry it.
    let pod_labels = BTreeMap::from([
        (
            "app.kubernetes.io/managed-by".to_string(),
            "stoker-operator".to_string(),
        ),
        (LABEL_INDEX_OF.to_string(), dp.name_any()),
    ]);
    Ok(Some(Job {
        metadata: child_meta(dp, index_job_name(dp, &dataset)),
        spec: Some(JobSpec {
            backoff_limit: Some(BACKOFF_LIMIT),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    restart_policy: Some("Never".to_string()),
                    // Where the decoders run: the nodes on the data network.
                    node_selector: (!d.node_selector.is_empty()).then(|| d.node_selector.clone()),
                    tolerations: (!d.tolerations.is_empty()).then(|| d.tolerations.clone()),
                    // The decoders' identity (IRSA, workload identity) and no API token.
                    service_account_name: Some(super::sidecar_rbac::decoder_service_account(dp)),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    security_context: Some(super::loader_pod_security()),
                    volumes: Some(vec![Volume {
                        name: "tmp".to_string(),
                        empty_dir: Some(EmptyDirVolumeSource::default()),
                        ..Volume::default()
                    }]),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        status: None,
    }))
}

/// `<pipeline>-index-<hash>`: the hash of what the index is built from.
pub fn index_job_name(dp: &DataPipeline, dataset: &IndexedDataset<'_>) -> String {
    let reindex = dp
        .annotations()
        .get(ANNOTATION_REINDEX)
        .map(String::as_str)
        .unwrap_or_default();
    let mut built_from = format!("{}\n{}\n{reindex}", dataset.files, dataset.index);
    // Parquet: the columns read are part of what the index holds.
    if let Some(image) = dataset.image_column {
        built_from += &format!("\n{image}");
    }
    if !dataset.columns.is_empty() {
        built_from += &format!("\n{}", dataset.columns.join(","));
    }
    let digest = Sha256::digest(built_from);
    let hash: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-index-{hash}", dp.name_any())
}
