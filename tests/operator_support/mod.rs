//! Support for the operator's end-to-end tests: CRD install, an in-process operator, polling,
//! and a metrics exporter the tests drive, scraped by a real Prometheus ([`exporter`]).
#![allow(dead_code)]

pub mod exporter;
pub mod prometheus_stub;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, CustomResourceExt};
use stoker_operator::api::DataPipeline;
use stoker_operator::build::BuildDefaults;
use stoker_operator::webhook::WebhookConfig;
use stoker_operator::{CancellationToken, Config};
use tokio::sync::OnceCell;

/// The Helm chart's directory.
pub fn chart() -> String {
    format!("{}/charts/stoker", stoker_testenv::manifest_dir().display())
}

/// Runs `cmd` (with `stdin` written to it), asserts it succeeded, and returns its stdout and
/// stderr.
pub fn run(mut cmd: Command, stdin: Option<&str>) -> String {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    if stdin.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.spawn().expect("spawn");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
    }
    let out = child.wait_with_output().expect("wait");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

pub const LOADER_IMAGE: &str = "registry.invalid/stoker/loader:test";

/// Installs the CRD once per test binary and waits until it is served.
pub async fn install_crd(client: &Client) {
    static DONE: OnceCell<()> = OnceCell::const_new();
    DONE.get_or_init(|| async {
        let api: Api<CustomResourceDefinition> = Api::all(client.clone());
        let crd = DataPipeline::crd();
        let name = crd.metadata.name.clone().expect("crd name");
        api.patch(
            &name,
            &PatchParams::apply("stoker-tests").force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("apply CRD");
        eventually("CRD established", Duration::from_secs(30), || async {
            let crd = api.get(&name).await.ok()?;
            let established = crd
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            established.then_some(())
        })
        .await;
        // Discovery lags Established by a moment.
        let dps: Api<DataPipeline> = Api::all(client.clone());
        eventually(
            "DataPipelines listable",
            Duration::from_secs(30),
            || async {
                dps.list(&ListParams::default().limit(1))
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
    })
    .await;
}

pub use stoker_testenv::eventually;

/// A client of `cp`'s API server as someone else: its kubeconfig's server and CA, the
/// credentials `who` sets (a token; or the admin's, impersonating a user).
pub async fn client_as_who(
    cp: &stoker_testenv::cluster::ControlPlane,
    who: impl FnOnce(&mut kube::config::AuthInfo),
) -> Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(cp.kubeconfig_path()).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("config");
    who(&mut config.auth_info);
    Client::try_from(config).expect("client")
}

/// An operator running in this process, scoped to one namespace.
pub struct Operator {
    pub shutdown: CancellationToken,
    pub webhook_addr: Option<SocketAddr>,
    pub metrics: std::sync::Arc<stoker_operator::telemetry::Metrics>,
    pub metrics_addr: Option<SocketAddr>,
    pub task: tokio::task::JoinHandle<Result<(), stoker_operator::RunError>>,
}

/// How the tests run an operator scoped to `namespace`: no lease, no autoscaler.
pub fn test_config(namespace: &str, webhook: Option<WebhookConfig>) -> Config {
    Config {
        watch_namespace: Some(namespace.to_string()),
        lease: None,
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.to_string(),
            // What injected sidecars get (the webhook test checks them).
            sidecar_resources: Some(
                serde_json::from_value(serde_json::json!({
                    "requests": {"cpu": "100m", "memory": "128Mi"},
                    "limits": {"cpu": "100m", "memory": "128Mi"}
                }))
                .expect("resources"),
            ),
            allowed_images: Vec::new(),
        },
        webhook,
        metrics_listen: None,
        installation: None,
        autoscaler: None,
    }
}

impl Operator {
    pub async fn start(client: Client, namespace: &str, webhook: Option<WebhookConfig>) -> Self {
        Self::start_with(client, test_config(namespace, webhook)).await
    }

    pub async fn start_with(client: Client, config: Config) -> Self {
        // The operator's warnings (a lost lease, a failing reconcile) in the failure output.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "stoker_operator=warn".into()),
            )
            .with_test_writer()
            .try_init();
        let shutdown = CancellationToken::new();
        let running = stoker_operator::start(client, config, shutdown.clone())
            .await
            .expect("operator starts");
        Self {
            shutdown,
            webhook_addr: running.webhook_addr,
            metrics: running.metrics,
            metrics_addr: running.metrics_addr,
            task: running.task,
        }
    }

    /// Graceful stop: the controller finishes in-flight reconciles and returns.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
    }
}

/// A DataPipeline for the simulated CPU nodes with a fixed decoder count.
pub fn pipeline(name: &str, replicas: i32, drain_seconds: i32) -> DataPipeline {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "stoker.dev/v1alpha1",
        "kind": "DataPipeline",
        "metadata": {"name": name},
        "spec": {
            "source": {"s3": {"bucket": "train-data", "endpoint": "http://127.0.0.1:9000", "forcePathStyle": true}},
            "transform": {"resize": {"mode": "crop", "width": 224, "height": 224}},
            "batch": {"size": 32, "shuffleSeed": 7},
            "trainer": {"prefetchBatches": 4, "sharedMemory": "512Mi"},
            "decoders": {
                "minReplicas": 1, "maxReplicas": 32, "drainSeconds": drain_seconds,
                "nodeSelector": {"stoker.dev/pool": "cpu"},
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            },
            "autoscaling": {"mode": "fixed", "replicas": replicas},
        }
    }))
    .expect("pipeline")
}

pub fn is_ready(pod: &Pod) -> bool {
    stoker_operator::controller::fleet::is_ready(pod)
}

pub fn is_draining(pod: &Pod) -> bool {
    stoker_operator::controller::fleet::is_draining(pod)
}

pub async fn decoders(client: &Client, ns: &str, pipeline: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.list(&ListParams::default().labels(&format!(
        "stoker.dev/pipeline={pipeline},stoker.dev/role=decoder"
    )))
    .await
    .expect("list decoders")
    .items
    .into_iter()
    .filter(|p| p.metadata.deletion_timestamp.is_none())
    .collect()
}

/// Waits until exactly `n` serving decoders exist and all are Ready; returns them.
pub async fn wait_ready_decoders(client: &Client, ns: &str, pipeline: &str, n: usize) -> Vec<Pod> {
    eventually(
        &format!("{n} ready decoders of {pipeline}"),
        Duration::from_secs(90),
        || async {
            let pods = decoders(client, ns, pipeline).await;
            let serving: Vec<Pod> = pods.into_iter().filter(|p| !is_draining(p)).collect();
            (serving.len() == n && serving.iter().all(is_ready)).then_some(serving)
        },
    )
    .await
}

pub fn uids(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().filter_map(|p| p.metadata.uid.clone()).collect()
}

/// Pods per node.
pub fn per_node(pods: &[Pod]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for p in pods {
        if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            *m.entry(n).or_insert(0) += 1;
        }
    }
    m
}

/// Spread skew over the eight CPU nodes (nodes without a decoder count as zero).
pub fn skew_over_cpu_nodes(pods: &[Pod]) -> usize {
    let counts = per_node(pods);
    assert!(
        counts.keys().all(|n| n.starts_with("cpu-")),
        "decoders must land on CPU nodes only: {counts:?}"
    );
    let all: Vec<usize> = (0..8)
        .map(|i| counts.get(&format!("cpu-{i}")).copied().unwrap_or(0))
        .collect();
    all.iter().max().copied().unwrap_or(0) - all.iter().min().copied().unwrap_or(0)
}
