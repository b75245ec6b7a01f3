//! Sends the autoscaler's local-decode share to the sidecars of a pipeline's trainers: when the
//! trainer node's own NIC is the bottleneck, more decoders cannot help, and the sidecars decode
//! that share of the batches themselves (`PUT /local-share` on the sidecar's metrics port).
//!
//! A sidecar is sent the share once per change; one not seen before is taken to be at the
//! share injection starts it with (0: every batch to the decoders), so pods are only dialled
//! when there is something to change. A failed send is retried at the next decision.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::autoscaling::lock;
use super::trainers;
use crate::autoscale::prometheus::http_client;
use crate::webhook::inject::SIDECAR_HEALTH_PORT;

/// The share an injected sidecar starts with (the webhook passes no `--local-share`).
const STARTING_SHARE: f64 = 0.0;

/// How long one sidecar may take to answer; a hung one is retried at the next decision.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// Per pipeline, the share each sidecar (by pod uid) last acknowledged.
pub struct LocalShareSender {
    http: reqwest::Client,
    /// The sidecar's metrics port (`SIDECAR_HEALTH_PORT`; tests use their own).
    port: u16,
    acknowledged: Mutex<BTreeMap<String, BTreeMap<String, f64>>>,
}

/// One trainer pod whose sidecar can be told the share.
#[derive(Debug, PartialEq)]
struct Sidecar {
    uid: String,
    pod: String,
    url: String,
}

impl LocalShareSender {
    pub fn new() -> Result<Self, reqwest::Error> {
        Ok(Self {
            http: http_client(SEND_TIMEOUT)?,
            port: SIDECAR_HEALTH_PORT as u16,
            acknowledged: Mutex::new(BTreeMap::new()),
        })
    }

    /// Sends `share` to every running sidecar of `pipeline` that has not acknowledged it yet.
    /// Returns how many sidecars were sent it and acknowledged.
    pub async fn send(&self, pipeline: &str, trainers: &[Pod], share: f64) -> usize {
        let sidecars = sidecars(trainers, self.port);
        let pending: Vec<Sidecar> = {
            let mut all = lock(&self.acknowledged);
            let acked = all.entry(pipeline.to_string()).or_default();
            // Pods that are gone are forgotten, so the map never grows with churn.
            acked.retain(|uid, _| sidecars.iter().any(|s| &s.uid == uid));
            sidecars
                .into_iter()
                .filter(|s| acked.get(&s.uid).copied().unwrap_or(STARTING_SHARE) != share)
                .collect()
        };
        let sends = pending.iter().map(|s| self.put(s, share));
        let results = futures::future::join_all(sends).await;
        let mut all = lock(&self.acknowledged);
        let acked = all.entry(pipeline.to_string()).or_default();
        let mut sent = 0;
        for (sidecar, ok) in pending.iter().zip(results) {
            if ok {
                acked.insert(sidecar.uid.clone(), share);
                sent += 1;
            }
        }
        sent
    }

    async fn put(&self, sidecar: &Sidecar, share: f64) -> bool {
        let response = self
            .http
            .put(&sidecar.url)
            .body(format!("{share}"))
            .send()
            .await;
        match response.map(|r| r.error_for_status()) {
            Ok(Ok(_)) => {
                tracing::info!(pod = %sidecar.pod, share, "local decode share sent");
                true
            }
            Ok(Err(e)) | Err(e) => {
                tracing::warn!(pod = %sidecar.pod, share, error = %e, "local decode share not sent; retried at the next decision");
                false
            }
        }
    }

    pub fn forget(&self, pipeline: &str) {
        lock(&self.acknowledged).remove(pipeline);
    }
}

/// The running, injected trainer pods with an IP, and their sidecar's share endpoint.
fn sidecars(trainers: &[Pod], port: u16) -> Vec<Sidecar> {
    trainers
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| trainers::is_injected(p))
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            if status.phase.as_deref() != Some("Running") {
                return None;
            }
            let ip = status.pod_ip.as_deref()?;
            // An IPv6 address needs brackets in a URL.
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip.to_string()
            };
            Some(Sidecar {
                uid: p.uid()?,
                pod: p.name_any(),
                url: format!("http://{host}:{port}/local-share"),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::Router;
    use axum::routing::put;

    use super::*;
    use crate::webhook::inject::SIDECAR_NAME;

    fn trainer(uid: &str, ip: &str, phase: &str, injected: bool) -> Pod {
        let init = if injected {
            serde_json::json!([{"name": SIDECAR_NAME}])
        } else {
            serde_json::json!([])
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("trainer-{uid}"), "uid": uid},
            "spec": {"containers": [{"name": "train"}], "initContainers": init},
            "status": {"phase": phase, "podIP": ip},
        }))
        .expect("pod")
    }

    #[test]
    fn only_running_injected_pods_with_an_ip_are_sent_the_share() {
        let pods = [
            trainer("a", "10.0.0.1", "Running", true),
            trainer("b", "10.0.0.2", "Pending", true),
            trainer("c", "10.0.0.3", "Running", false),
            trainer("d", "fd00::4", "Running", true),
        ];
        let urls: Vec<String> = sidecars(&pods, 9091).into_iter().map(|s| s.url).collect();
        assert_eq!(
            urls,
            [
                "http://10.0.0.1:9091/local-share",
                "http://[fd00::4]:9091/local-share",
            ]
        );
    }

    /// A sidecar stand-in on 127.0.0.1 recording the bodies it is sent, and its port.
    async fn fake_sidecar() -> (u16, Arc<Mutex<Vec<String>>>) {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let seen = bodies.clone();
        let app = Router::new().route(
            "/local-share",
            put(move |body: String| {
                let seen = seen.clone();
                async move {
                    seen.lock().unwrap().push(body);
                    "ok"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (port, bodies)
    }

    #[tokio::test]
    async fn a_share_is_sent_once_per_change_and_retried_until_acknowledged() {
        let (port, bodies) = fake_sidecar().await;
        let mut sender = LocalShareSender::new().expect("client");
        sender.port = port;
        let pods = [
            trainer("up", "127.0.0.1", "Running", true),
            // Nothing listens on 127.0.0.2 at that port: the send fails and is retried later.
            trainer("down", "127.0.0.2", "Running", true),
        ];
        assert_eq!(sender.send("ns/p", &pods, 0.25).await, 1);
        assert_eq!(sender.send("ns/p", &pods, 0.25).await, 0, "unchanged");
        assert_eq!(sender.send("ns/p", &pods, 0.5).await, 1);
        assert_eq!(*bodies.lock().unwrap(), ["0.25", "0.5"]);
        let acked = lock(&sender.acknowledged)["ns/p"].clone();
        assert_eq!(acked.get("up"), Some(&0.5));
        assert_eq!(acked.get("down"), None, "failed sends are not acknowledged");
        // A pod that is gone is forgotten.
        assert_eq!(sender.send("ns/p", &pods[1..], 0.5).await, 0);
        assert!(lock(&sender.acknowledged)["ns/p"].is_empty());
        // New sidecars already decode nothing locally: a share of 0 dials nobody.
        let fresh = [trainer("new", "127.0.0.1", "Running", true)];
        assert_eq!(sender.send("ns/q", &fresh, 0.0).await, 0);
        assert_eq!(
            bodies.lock().unwrap().len(),
            2,
            "no request for an unchanged share"
        );
    }
}
