//! The sidecar's reads from the Kubernetes API: decoder discovery (the operator's decode pods:
//! by label selector, and of those only the ones the pipeline owns) and the local-decode share the operator writes on the sidecar's own pod.
//! The only file of the loader that talks to the Kubernetes API.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use kube::runtime::{WatchStreamExt, watcher};

use stoker_contract::{ANNOTATION_LOCAL_SHARE, DECODER_GRPC_PORT, LABEL_DRAINING};

use super::{DiscoveryError, DiscoveryFuture, WorkerDiscovery};

pub struct KubeWorkers {
    pub client: kube::Client,
    pub namespace: String,
    /// e.g. `stoker.dev/pipeline=qwen3vl-pretrain,stoker.dev/role=decoder`
    pub selector: String,
    /// The DataPipeline's UID: only pods it controls are decoders (labels anyone can copy).
    /// `None` (a sidecar run by hand) takes every labelled pod.
    pub owner_uid: Option<String>,
    pub port: u16,
}

impl KubeWorkers {
    /// In-cluster (service account) or kubeconfig configuration.
    pub async fn connect(
        namespace: String,
        selector: String,
        owner_uid: Option<String>,
    ) -> Result<Self, DiscoveryError> {
        let client = kube::Client::try_default()
            .await
            .map_err(|e| DiscoveryError::Kube {
                namespace: namespace.clone(),
                selector: selector.clone(),
                detail: e.to_string(),
            })?;
        Ok(Self {
            client,
            namespace,
            selector,
            owner_uid,
            port: DECODER_GRPC_PORT,
        })
    }
}

impl WorkerDiscovery for KubeWorkers {
    fn describe(&self) -> String {
        format!("pods in {} with {}", self.namespace, self.selector)
    }

    fn discover(&self) -> DiscoveryFuture<'_> {
        Box::pin(async move {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
            let list = pods
                .list(&ListParams::default().labels(&self.selector))
                .await
                .map_err(|e| DiscoveryError::Kube {
                    namespace: self.namespace.clone(),
                    selector: self.selector.clone(),
                    detail: e.to_string(),
                })?;
            let mut out: Vec<String> = list
                .items
                .iter()
                .filter(|p| controlled_by(p, self.owner_uid.as_deref()))
                .filter_map(|p| serving_address(p, self.port))
                .collect();
            out.sort();
            Ok(out)
        })
    }
}

/// Whether `owner_uid` (when given) is the controller among `pod`'s owners.
pub fn controlled_by(pod: &Pod, owner_uid: Option<&str>) -> bool {
    let Some(uid) = owner_uid else {
        return true;
    };
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == uid && o.controller == Some(true))
}

/// The gRPC endpoint of a pod that should get batches: Ready, not draining, with an IP.
pub fn serving_address(pod: &Pod, port: u16) -> Option<String> {
    let draining = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_DRAINING))
        .is_some_and(|v| v == "true");
    if draining || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_ref().filter(|ip| !ip.is_empty())?;
    if !ready {
        return None;
    }
    // IPv6 pod addresses need brackets in a URI.
    Some(if ip.contains(':') {
        format!("http://[{ip}]:{port}")
    } else {
        format!("http://{ip}:{port}")
    })
}

/// The share a pod's annotation asks for: `None` without one, `Some(Err)` for a value outside
/// 0..=1 or not a number.
pub fn local_share_of(pod: &Pod) -> Option<Result<f64, String>> {
    let value = pod
        .metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_LOCAL_SHARE)?;
    Some(
        value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|v| (0.0..=1.0).contains(v))
            .ok_or_else(|| value.clone()),
    )
}

/// Watches the sidecar's own pod and calls `apply` with each new share its annotation asks for,
/// for as long as the returned future runs. `client`: discovery's, else the in-cluster or
/// kubeconfig one. A pod without the annotation changes nothing; a value out of range is logged
/// and ignored. The watch resumes by itself after API errors.
/// `client`, else one from the environment (in-cluster or KUBECONFIG); `None`, logged with
/// what goes without it, when there is no Kubernetes API.
pub async fn client_or_default(
    client: Option<kube::Client>,
    without: &str,
) -> Option<kube::Client> {
    if client.is_some() {
        return client;
    }
    match kube::Client::try_default().await {
        Ok(c) => Some(c),
        Err(err) => {
            tracing::warn!(%err, "no Kubernetes API: {without}");
            None
        }
    }
}

pub async fn follow_local_share(
    client: Option<kube::Client>,
    namespace: String,
    pod: String,
    apply: impl Fn(f64),
) {
    let Some(client) = client_or_default(client, "the local decode share stays as started").await
    else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let own = watcher::Config::default().fields(&format!("metadata.name={pod}"));
    let mut changes = std::pin::pin!(watcher(pods, own).default_backoff().applied_objects());
    let mut current = None;
    while let Some(change) = changes.next().await {
        match change.as_ref().map(local_share_of) {
            Ok(Some(Ok(share))) if current != Some(share) => {
                current = Some(share);
                apply(share);
            }
            Ok(Some(Err(value))) => {
                tracing::warn!(pod = %pod, %value, "{ANNOTATION_LOCAL_SHARE} is not a number in 0..=1; ignored");
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(pod = %pod, %err, "watching the sidecar's own pod"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_annotation_reads_as_a_number_in_range() {
        let with = |v: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": "t", "annotations": { ANNOTATION_LOCAL_SHARE: v } }
            }))
            .unwrap()
        };
        assert_eq!(local_share_of(&with("0.25")), Some(Ok(0.25)));
        assert_eq!(local_share_of(&with("1")), Some(Ok(1.0)));
        assert_eq!(local_share_of(&with("1.5")), Some(Err("1.5".into())));
        assert_eq!(local_share_of(&with("half")), Some(Err("half".into())));
        assert_eq!(local_share_of(&Pod::default()), None);
    }

    #[test]
    fn only_pods_the_pipeline_controls_are_decoders() {
        let owned = |uid: &str, controller: bool| -> Pod {
            serde_json::from_value(serde_json::json!({ "metadata": { "name": "d",
                "ownerReferences": [{ "apiVersion": "stoker.dev/v1alpha1", "kind": "DataPipeline",
                    "name": "p", "uid": uid, "controller": controller }] } }))
            .unwrap()
        };
        assert!(controlled_by(&owned("u1", true), Some("u1")));
        assert!(!controlled_by(&owned("u1", false), Some("u1")));
        assert!(!controlled_by(&owned("u2", true), Some("u1")));
        assert!(!controlled_by(&Pod::default(), Some("u1")));
        assert!(
            controlled_by(&Pod::default(), None),
            "a hand-run sidecar filters by label only"
        );
    }

    fn pod(ready: &str, ip: Option<&str>, draining: Option<&str>) -> Pod {
        let labels: Option<std::collections::BTreeMap<String, String>> = draining.map(|d| {
            [(LABEL_DRAINING.to_string(), d.to_string())]
                .into_iter()
                .collect()
        });
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": "d", "labels": labels },
            "status": {
                "podIP": ip,
                "conditions": [{ "type": "Ready", "status": ready }]
            }
        }))
        .unwrap()
    }

    #[test]
    fn only_ready_non_draining_pods_with_an_ip_serve() {
        assert_eq!(
            serving_address(&pod("True", Some("10.0.0.7"), None), 50051).as_deref(),
            Some("http://10.0.0.7:50051")
        );
        assert_eq!(
            serving_address(&pod("True", Some("fd00::1"), Some("false")), 50051).as_deref(),
            Some("http://[fd00::1]:50051")
        );
        assert_eq!(
            serving_address(&pod("False", Some("10.0.0.7"), None), 50051),
            None
        );
        assert_eq!(serving_address(&pod("True", None, None), 50051), None);
        assert_eq!(
            serving_address(&pod("True", Some("10.0.0.7"), Some("true")), 50051),
            None
        );
    }
}
