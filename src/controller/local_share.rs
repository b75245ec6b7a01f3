//! Tells the sidecars of a pipeline's trainers the autoscaler's local-decode share: when the
//! trainer node's own NIC is the bottleneck, more decoders cannot help, and the sidecars decode
//! that share of the batches themselves.
//!
//! The share is an annotation on each injected trainer pod (`stoker.dev/local-share`), which its
//! sidecar watches through the Kubernetes API (its Role already reads pods): only who may patch
//! the pod can change it, and nothing on the network can (the sidecar's port takes no writes).
//! A pod is patched only when its annotation says otherwise; a pod without one decodes nothing
//! locally. Pure: [`plan`] is part of the desired state, the apply step patches.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;

use super::trainers;
use crate::api::ANNOTATION_LOCAL_SHARE;

/// The share a sidecar decodes without an annotation (the webhook passes no `--local-share`).
const STARTING_SHARE: f64 = 0.0;

/// Trainer pods to tell a new share, and the merge patch that tells them.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalShare {
    pub share: f64,
    pub pods: Vec<String>,
}

impl LocalShare {
    pub fn patch(&self) -> serde_json::Value {
        json!({ "metadata": { "annotations": { ANNOTATION_LOCAL_SHARE: annotation_value(self.share) } } })
    }
}

/// The pods of `trainers` to tell `share`, `None` when every one already carries it.
pub fn plan(trainers: &[Pod], share: f64) -> Option<LocalShare> {
    let pods = pods_to_tell(trainers, share);
    (!pods.is_empty()).then_some(LocalShare { share, pods })
}

/// The annotation's value for `share`: "0.25".
fn annotation_value(share: f64) -> String {
    format!("{share}")
}

/// The injected, live trainer pods whose annotation is not `share` yet.
fn pods_to_tell(trainers: &[Pod], share: f64) -> Vec<String> {
    trainers
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| trainers::is_injected(p))
        .filter(|p| {
            let told = p
                .annotations()
                .get(ANNOTATION_LOCAL_SHARE)
                .map_or(Some(STARTING_SHARE), |v| v.parse::<f64>().ok());
            told != Some(share)
        })
        .map(ResourceExt::name_any)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::sidecar::SIDECAR_NAME;

    fn trainer(name: &str, injected: bool, share: Option<&str>) -> Pod {
        let init = if injected {
            json!([{"name": SIDECAR_NAME}])
        } else {
            json!([])
        };
        let annotations = share.map_or(json!({}), |s| json!({ ANNOTATION_LOCAL_SHARE: s }));
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"containers": [{"name": "train"}], "initContainers": init},
        }))
        .expect("pod")
    }

    #[test]
    fn only_injected_pods_that_say_otherwise_are_told() {
        let pods = [
            trainer("fresh", true, None),
            trainer("told", true, Some("0.25")),
            trainer("stale", true, Some("0.5")),
            trainer("garbled", true, Some("lots")),
            trainer("plain", false, None),
        ];
        assert_eq!(
            pods_to_tell(&pods, 0.25),
            ["fresh", "stale", "garbled"],
            "the pod already at 0.25 and the one without a sidecar are left alone"
        );
        assert_eq!(
            pods_to_tell(&pods, 0.0),
            ["told", "stale", "garbled"],
            "a pod without the annotation already decodes nothing locally"
        );
        assert_eq!(plan(&pods[1..2], 0.25), None, "nothing to tell");
    }

    #[test]
    fn the_annotation_reads_back_as_the_share() {
        for share in [0.0, 0.25, 1.0 / 3.0, 1.0] {
            assert_eq!(annotation_value(share).parse::<f64>().ok(), Some(share));
        }
    }
}
