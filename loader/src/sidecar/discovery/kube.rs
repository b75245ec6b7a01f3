//! Decoder discovery from the Kubernetes API: the operator's decode pods, by label selector.
//! The only file of the loader that depends on kube, so the rest builds and tests without it.

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

use super::{DECODER_GRPC_PORT, DiscoveryError, DiscoveryFuture, WorkerDiscovery};

/// Set by the operator on a decode pod it is about to remove: the sidecar stops sending to it
/// while it finishes its in-flight batches.
pub const DRAINING_LABEL: &str = "stoker.dev/draining";

pub struct KubeWorkers {
    pub client: kube::Client,
    pub namespace: String,
    /// e.g. `stoker.dev/pipeline=qwen3vl-pretrain,stoker.dev/role=decoder`
    pub selector: String,
    pub port: u16,
}

impl KubeWorkers {
    /// In-cluster (service account) or kubeconfig configuration.
    pub async fn connect(namespace: String, selector: String) -> Result<Self, DiscoveryError> {
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
                .filter_map(|p| serving_address(p, self.port))
                .collect();
            out.sort();
            Ok(out)
        })
    }
}

/// The gRPC endpoint of a pod that should get batches: Ready, not draining, with an IP.
pub fn serving_address(pod: &Pod, port: u16) -> Option<String> {
    let draining = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(DRAINING_LABEL))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: &str, ip: Option<&str>, draining: Option<&str>) -> Pod {
        let labels: Option<std::collections::BTreeMap<String, String>> = draining.map(|d| {
            [(DRAINING_LABEL.to_string(), d.to_string())]
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
