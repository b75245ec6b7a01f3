//! Pure builders: one per child object of a `DataPipeline`. Each takes the pipeline (and the
//! operator's defaults) and returns the object to apply; none touches the network.

pub mod config_map;
pub mod decoder_pod;
pub mod network_policy;
pub mod service;
pub mod sidecar_rbac;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_DECODER};

/// gRPC port of a decoder.
pub const DECODER_GRPC_PORT: i32 = 50051;
/// Metrics and readiness port of a decoder.
pub const DECODER_METRICS_PORT: i32 = 9090;
/// Where the pipeline's ConfigMap is mounted in decoders and sidecars.
pub const CONFIG_DIR: &str = "/etc/stoker";
/// File in the ConfigMap that the loader reads.
pub const CONFIG_FILE: &str = "pipeline.json";

/// Operator-wide inputs to the builders.
#[derive(Clone, Debug)]
pub struct BuildDefaults {
    /// The stoker-loader image used for decoders and sidecars unless the pipeline names one.
    pub loader_image: String,
}

impl Default for BuildDefaults {
    fn default() -> Self {
        Self {
            loader_image: "ghcr.io/stoker-dev/stoker-loader:0.1.0".into(),
        }
    }
}

pub fn decoder_service_name(dp: &DataPipeline) -> String {
    format!("{}-decoders", dp.name_any())
}

pub fn config_map_name(pipeline: &str) -> String {
    format!("{pipeline}-config")
}

pub fn network_policy_name(dp: &DataPipeline) -> String {
    format!("{}-decoders", dp.name_any())
}

pub fn sidecar_rbac_name(pipeline: &str) -> String {
    format!("stoker-{pipeline}-sidecar")
}

/// Labels every decoder of the pipeline carries (the selector of its Service and spread).
pub fn decoder_selector_labels(pipeline: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_PIPELINE.to_string(), pipeline.to_string()),
        (LABEL_ROLE.to_string(), ROLE_DECODER.to_string()),
    ])
}

/// The label selector sidecars use to discover serving decoders.
pub fn decoder_discovery_selector(pipeline: &str) -> String {
    format!(
        "{LABEL_PIPELINE}={pipeline},{LABEL_ROLE}={ROLE_DECODER},{}=false",
        crate::api::LABEL_DRAINING
    )
}

/// Labels on every object the operator creates for a pipeline.
pub fn common_labels(dp: &DataPipeline) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_PIPELINE.to_string(), dp.name_any()),
        ("app.kubernetes.io/managed-by".to_string(), "stoker-operator".to_string()),
        ("app.kubernetes.io/part-of".to_string(), "stoker".to_string()),
    ])
}

/// Metadata of a child: name, namespace, labels, and a controller owner reference so that
/// deleting the pipeline garbage-collects it.
pub fn child_meta(dp: &DataPipeline, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: dp.namespace(),
        labels: Some(common_labels(dp)),
        owner_references: owner_reference(dp).map(|o| vec![o]),
        ..ObjectMeta::default()
    }
}

pub fn owner_reference(dp: &DataPipeline) -> Option<OwnerReference> {
    dp.controller_owner_ref(&()).map(|mut o| {
        o.block_owner_deletion = Some(true);
        o
    })
}
