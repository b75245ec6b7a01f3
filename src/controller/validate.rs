//! Checks the API server cannot make (its CEL rules cover the rest). Pure.

use crate::api::DataPipelineSpec;
use crate::controller::build::BuildDefaults;

/// Problems that keep the pipeline from running as written; empty when it can.
pub fn validate(spec: &DataPipelineSpec, defaults: &BuildDefaults) -> Vec<String> {
    let mut problems = Vec::new();
    let image = spec
        .decoders
        .image
        .as_deref()
        .unwrap_or(&defaults.loader_image);
    if image.trim().is_empty() {
        problems
            .push("decoders.image is empty and the operator has no default loader image".into());
    }
    // Rules the API server also enforces, kept here for servers that skip CEL (or objects
    // written before a rule existed).
    if spec.decoders.min_replicas > spec.decoders.max_replicas {
        problems.push("decoders.minReplicas must not exceed decoders.maxReplicas".into());
    }
    if spec.trainer.shared_memory.parse::<u64>().is_err()
        && !spec
            .trainer
            .shared_memory
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .chars()
            .all(|c| c.is_ascii_digit() || c == '.')
    {
        problems.push(format!(
            "trainer.sharedMemory {:?} is not a quantity",
            spec.trainer.shared_memory
        ));
    }
    problems
}
