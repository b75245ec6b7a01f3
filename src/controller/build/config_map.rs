//! The pipeline's configuration as the loader reads it (`/etc/stoker/pipeline.json`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use serde::{Deserialize, Serialize};

use super::{
    CONFIG_FILE, DECODER_GRPC_PORT, child_meta, config_map_name, decoder_discovery_selector,
};
use crate::api::DataPipeline;
use crate::api::v1alpha1::{Batch, Source, Trainer, Transform};

/// The contract between the operator and `stoker-loader` (decoders and sidecars).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoaderConfig {
    pub pipeline: String,
    pub namespace: String,
    pub source: Source,
    pub transform: Transform,
    pub batch: Batch,
    pub trainer: Trainer,
    /// Label selector of decoders that may receive work.
    pub decoder_selector: String,
    pub decoder_port: i32,
}

pub fn loader_config(dp: &DataPipeline) -> LoaderConfig {
    LoaderConfig {
        pipeline: dp.name_any(),
        namespace: dp.namespace().unwrap_or_default(),
        source: dp.spec.source.clone(),
        transform: dp.spec.transform.clone(),
        batch: dp.spec.batch.clone(),
        trainer: dp.spec.trainer.clone(),
        decoder_selector: decoder_discovery_selector(&dp.name_any()),
        decoder_port: DECODER_GRPC_PORT,
    }
}

pub fn config_map(dp: &DataPipeline) -> Result<ConfigMap, serde_json::Error> {
    let json = serde_json::to_string_pretty(&loader_config(dp))?;
    Ok(ConfigMap {
        metadata: child_meta(dp, config_map_name(&dp.name_any())),
        data: Some(BTreeMap::from([(CONFIG_FILE.to_string(), json)])),
        ..ConfigMap::default()
    })
}
