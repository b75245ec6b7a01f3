//! A real Kubernetes control plane on loopback: etcd, kube-apiserver (TLS, RBAC),
//! kube-controller-manager, kube-scheduler and the KWOK controller with simulated nodes.
//!
//! Tests share one control plane per test binary ([`ControlPlane::shared`]) and take a fresh
//! namespace each ([`ControlPlane::namespace`]). Components' logs are kept in the cluster's
//! directory and printed when a test fails.

use crate::certs::{TestCa, service_account_key};
use crate::net::free_port;
use crate::nodes::{SimNode, default_nodes};
use crate::process::Component;
use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The lifecycle KWOK plays for simulated nodes and pods.
const KWOK_STAGES: &str = include_str!("../kwok/stages.yaml");

/// How to start a control plane.
pub struct Options {
    /// Where certificates, etcd data, the kubeconfig and logs go. `None`: a temporary directory
    /// removed when the control plane is dropped.
    pub dir: Option<PathBuf>,
    /// The simulated nodes to register.
    pub nodes: Vec<SimNode>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            dir: None,
            nodes: default_nodes(),
        }
    }
}

pub struct ControlPlane {
    dir: PathBuf,
    _tempdir: Option<tempfile::TempDir>,
    bin_dir: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    ca_pem: String,
    nodes: Vec<SimNode>,
    components: Mutex<Vec<Component>>,
}

/// The directory holding the Go-built binaries (see `scripts/tools.sh`).
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("STOKER_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var("STOKER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/stoker")
        });
    cache.join("bin")
}

/// What the API server audits: every request of a ServiceAccount (the operator's, a
/// sidecar's, a decoder's) at Metadata level, once it is answered; the control plane's own
/// accounts (kube-system) and people are left out, which keeps the log small.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: None
    userGroups: [\"system:serviceaccounts:kube-system\"]
  - level: Metadata
    userGroups: [\"system:serviceaccounts\"]
  - level: None
";
const AUDIT_LOG: &str = "audit.log";

impl ControlPlane {
    /// The control plane of this test binary, started on first use.
    ///
    /// Blocking; safe to call from any test, sync or async. Started from a thread that lives as
    /// long as the process, so the components die with the test binary however it ends.
    pub fn shared() -> &'static ControlPlane {
        static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
        let result = SHARED.get_or_init(|| {
            std::thread::spawn(|| {
                ControlPlane::start(Options::default()).map_err(|e| format!("{e:#}"))
            })
            .join()
            .unwrap_or_else(|_| Err("control plane start-up panicked".into()))
        });
        match result {
            Ok(cp) => cp,
            Err(e) => panic!("test control plane failed to start: {e}"),
        }
    }

    /// Starts every component, registers the simulated nodes and waits until they are Ready.
    pub fn start(options: Options) -> Result<ControlPlane> {
        let bin_dir = bin_dir();
        for bin in [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "kubectl",
        ] {
            if !bin_dir.join(bin).exists() {
                bail!(
                    "{} not found: run scripts/tools.sh to build the control plane",
                    bin_dir.join(bin).display()
                );
            }
        }
        let (tempdir, dir) = match options.dir {
            Some(dir) => {
                std::fs::create_dir_all(&dir)?;
                (None, dir)
            }
            None => {
                remove_abandoned_dirs(&std::env::temp_dir());
                let t = tempfile::Builder::new().prefix(DIR_PREFIX).tempdir()?;
                std::fs::write(
                    t.path().join(OWNER_PID_FILE),
                    std::process::id().to_string(),
                )?;
                let dir = t.path().to_path_buf();
                (Some(t), dir)
            }
        };
        let pki = dir.join("pki");
        std::fs::create_dir_all(&pki)?;
        let ca = TestCa::new("stoker-test-ca")?;
        let serving = ca.serving(
            "kube-apiserver",
            &[
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "10.96.0.1",
            ],
        )?;
        let admin = ca.client("stoker-admin", &["system:masters"])?;
        let (sa_key, sa_pub) = service_account_key()?;
        let write = |name: &str, text: &str| std::fs::write(pki.join(name), text);
        write("ca.crt", &ca.cert_pem())?;
        write("ca.key", ca.key_pem())?;
        write("apiserver.crt", &serving.cert_pem)?;
        write("apiserver.key", &serving.key_pem)?;
        write("sa.key", &sa_key)?;
        write("sa.pub", &sa_pub)?;
        std::fs::write(dir.join("audit-policy.yaml"), AUDIT_POLICY)?;

        let mut cp = ControlPlane {
            kubeconfig: dir.join("kubeconfig"),
            dir: dir.clone(),
            _tempdir: tempdir,
            bin_dir,
            server: String::new(),
            ca_pem: ca.cert_pem(),
            nodes: options.nodes,
            components: Mutex::new(Vec::new()),
        };
        let logs = dir.join("logs");
        let p = |name: &str| pki.join(name).display().to_string();

        let etcd_port = free_port()?;
        let etcd_peer = free_port()?;
        cp.run(Component::start(
            "etcd",
            &cp.bin_dir.join("etcd"),
            &[
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
                format!("--advertise-client-urls=http://127.0.0.1:{etcd_port}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-cluster=default=http://127.0.0.1:{etcd_peer}"),
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
            &logs,
        )?);
        cp.wait_for("etcd", Duration::from_secs(60), || {
            let etcd = SocketAddr::from(([127, 0, 0, 1], etcd_port));
            crate::http::blocking::get(etcd, "/health").is_ok_and(|(status, _)| status == 200)
        })?;

        let api_port = free_port()?;
        cp.server = format!("https://127.0.0.1:{api_port}");
        cp.run(Component::start(
            "kube-apiserver",
            &cp.bin_dir.join("kube-apiserver"),
            &[
                format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={api_port}"),
                format!("--tls-cert-file={}", p("apiserver.crt")),
                format!("--tls-private-key-file={}", p("apiserver.key")),
                format!("--client-ca-file={}", p("ca.crt")),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", p("sa.pub")),
                format!("--service-account-signing-key-file={}", p("sa.key")),
                "--service-cluster-ip-range=10.96.0.0/16".into(),
                "--authorization-mode=RBAC".into(),
                "--endpoint-reconciler-type=none".into(),
                // Webhooks and aggregated APIs behind a Service are called at the Service's
                // endpoint addresses (pod IPs, routed here) instead of its cluster IP (no
                // kube-proxy here): what a Helm-installed webhook needs.
                "--enable-aggregator-routing=true".into(),
                "--allow-privileged=true".into(),
                "--profiling=false".into(),
                format!(
                    "--audit-policy-file={}",
                    dir.join("audit-policy.yaml").display()
                ),
                format!("--audit-log-path={}", dir.join(AUDIT_LOG).display()),
                "--v=1".into(),
            ],
            &logs,
        )?);
        cp.write_kubeconfig(&admin.cert_pem, &admin.key_pem)?;
        let kubectl_ready = || {
            cp.kubectl()
                .args(["get", "--raw", "/readyz"])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        };
        cp.wait_for("kube-apiserver", Duration::from_secs(120), kubectl_ready)?;

        let kubeconfig = cp.kubeconfig.display().to_string();
        cp.run(Component::start(
            "kube-controller-manager",
            &cp.bin_dir.join("kube-controller-manager"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                format!("--authentication-kubeconfig={kubeconfig}"),
                format!("--authorization-kubeconfig={kubeconfig}"),
                "--leader-elect=false".into(),
                format!("--service-account-private-key-file={}", p("sa.key")),
                format!("--root-ca-file={}", p("ca.crt")),
                "--use-service-account-credentials=true".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port()?),
                "--v=1".into(),
            ],
            &logs,
        )?);
        cp.run(Component::start(
            "kube-scheduler",
            &cp.bin_dir.join("kube-scheduler"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                format!("--authentication-kubeconfig={kubeconfig}"),
                format!("--authorization-kubeconfig={kubeconfig}"),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port()?),
                "--v=1".into(),
            ],
            &logs,
        )?);
        std::fs::write(dir.join("kwok.yaml"), KWOK_STAGES)?;
        cp.run(Component::start(
            "kwok",
            &cp.bin_dir.join("kwok"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                "--manage-all-nodes=false".into(),
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".into(),
                // Pod IPs are status values only: nothing dials them.
                "--cidr=10.244.0.0/16".into(),
                "--node-ip=10.240.0.1".into(),
                "--node-lease-duration-seconds=40".into(),
                format!("--server-address=127.0.0.1:{}", free_port()?),
                format!("--config={}", dir.join("kwok.yaml").display()),
            ],
            &logs,
        )?);

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(cp.register_nodes())?;
        Ok(cp)
    }

    fn run(&self, component: Component) {
        self.components
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(component);
    }

    /// Polls `ready` until it holds; fails early, with the logs, when a component has exited.
    fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(dead) = self.exited_component() {
                bail!(
                    "{dead} exited while waiting for {what}\n{}",
                    self.logs_tail(40)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    self.logs_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn exited_component(&self) -> Option<String> {
        let mut components = self.components.lock().unwrap_or_else(|e| e.into_inner());
        components
            .iter_mut()
            .find_map(|c| c.exited().map(|status| format!("{} ({status})", c.name)))
    }

    async fn register_nodes(&self) -> Result<()> {
        let client = self.client().await?;
        let nodes: Api<Node> = Api::all(client.clone());
        for node in &self.nodes {
            nodes
                .create(&PostParams::default(), &node.to_node())
                .await
                .with_context(|| format!("register node {}", node.name))?;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = nodes
                .list(&Default::default())
                .await?
                .items
                .iter()
                .filter(|n| node_ready(n))
                .count();
            // The service-account controller has created `default` once kube-controller-manager runs.
            let sa_ready = Api::<ServiceAccount>::namespaced(client.clone(), "default")
                .get_opt("default")
                .await?
                .is_some();
            if ready == self.nodes.len() && sa_ready {
                return Ok(());
            }
            if let Some(dead) = self.exited_component() {
                bail!(
                    "{dead} exited while waiting for nodes\n{}",
                    self.logs_tail(40)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{ready}/{} nodes Ready, default service account {}, after 120s\n{}",
                    self.nodes.len(),
                    if sa_ready { "present" } else { "missing" },
                    self.logs_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn write_kubeconfig(&self, cert_pem: &str, key_pem: &str) -> Result<()> {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stoker\n  cluster:\n    server: {}\n    certificate-authority-data: {}\nusers:\n- name: admin\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: stoker\n  context: {{cluster: stoker, user: admin, namespace: default}}\ncurrent-context: stoker\n",
            self.server,
            b64(&self.ca_pem),
            b64(cert_pem),
            b64(key_pem),
        );
        std::fs::write(&self.kubeconfig, text)?;
        Ok(())
    }

    /// An admin (`system:masters`) client, bound to the calling tokio runtime.
    pub async fn client(&self) -> Result<kube::Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// A client that authenticates as a ServiceAccount, with a token from the TokenRequest API,
    /// so that a test runs code with exactly the RBAC that account is granted.
    pub async fn client_for_service_account(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<kube::Client> {
        let admin = self.client().await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(admin, namespace);
        let request = TokenRequest {
            metadata: ObjectMeta::default(),
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..Default::default()
            }),
            status: None,
        };
        let token: TokenRequest = accounts
            .create_subresource("token", name, &PostParams::default(), &request)
            .await
            .with_context(|| format!("token for serviceaccount {namespace}/{name}"))?;
        let token = token
            .status
            .and_then(|s| s.token)
            .ok_or_else(|| anyhow!("TokenRequest returned no token"))?;
        let mut config = kube::Config::new(self.server.parse()?);
        config.root_cert = Some(vec![pem_to_der(&self.ca_pem)?]);
        config.auth_info.token = Some(token.into());
        config.default_namespace = namespace.to_string();
        Ok(kube::Client::try_from(config)?)
    }

    /// A fresh namespace for one test, deleted when the returned guard drops. It enforces the
    /// restricted Pod Security Standard ([`restricted_namespace_labels`]), as a cluster's
    /// training namespaces do: the API server refuses any pod in it that is not restricted.
    pub async fn namespace(&'static self, prefix: &str) -> TestNamespace {
        self.namespace_enforcing(prefix, "restricted").await
    }

    /// A namespace that admits privileged pods: only for tests of the node runtime's
    /// host-process mode, whose containers are root processes of this machine and say so.
    pub async fn privileged_namespace(&'static self, prefix: &str) -> TestNamespace {
        self.namespace_enforcing(prefix, "privileged").await
    }

    async fn namespace_enforcing(&'static self, prefix: &str, level: &str) -> TestNamespace {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let result: Result<kube::Client> = async {
            let client = self.client().await?;
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some([(POD_SECURITY_ENFORCE.to_string(), level.to_string())].into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            Api::<Namespace>::all(client.clone())
                .create(&PostParams::default(), &ns)
                .await?;
            // Pods are refused until the namespace's default service account exists.
            let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
            let deadline = Instant::now() + Duration::from_secs(30);
            while accounts.get_opt("default").await?.is_none() {
                if Instant::now() > deadline {
                    bail!("namespace {name} got no default service account within 30s");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(client)
        }
        .await;
        match result {
            Ok(client) => TestNamespace {
                name,
                client,
                cluster: self,
            },
            Err(e) => panic!(
                "create test namespace {name}: {e:#}\n{}",
                self.logs_tail(40)
            ),
        }
    }

    /// `kubectl` with this cluster's kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.bin_dir.join("kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()));
        cmd
    }

    /// `helm` with this cluster's kubeconfig.
    pub fn helm(&self) -> Command {
        let mut cmd = Command::new(self.bin_dir.join("helm"));
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", self.dir.join("helm/cache"));
        cmd.env("HELM_CONFIG_HOME", self.dir.join("helm/config"))
            .env("HELM_DATA_HOME", self.dir.join("helm/data"));
        cmd
    }

    /// The API server's audit log so far: one JSON object per request a ServiceAccount made
    /// (outside kube-system), with its verb, objectRef, user and responseStatus.
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join(AUDIT_LOG))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect()
    }

    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn nodes(&self) -> &[SimNode] {
        &self.nodes
    }

    /// The last `lines` of every component's log, for failure reports.
    pub fn logs_tail(&self, lines: usize) -> String {
        let components = self.components.lock().unwrap_or_else(|e| e.into_inner());
        components
            .iter()
            .map(|c| {
                format!(
                    "----- {} ({}) -----\n{}",
                    c.name,
                    c.log.display(),
                    c.log_tail(lines)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops every component, newest first.
    pub fn stop(&self) {
        let mut components = self.components.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(mut c) = components.pop() {
            c.stop(Duration::from_secs(10));
        }
    }
}

const DIR_PREFIX: &str = "stoker-cluster-";
/// The process a temporary control-plane directory belongs to.
const OWNER_PID_FILE: &str = "owner.pid";

/// Removes the temporary directories of control planes whose process is gone. The shared one
/// lives in a static, which Rust never drops, so without this every test binary left its
/// directory behind: ~125 MB of etcd data each, 23 GB after a few days of CI runs here.
fn remove_abandoned_dirs(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let dirs = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(DIR_PREFIX));
    for dir in dirs.map(|e| e.path()) {
        // No pid yet: a control plane starting in another process right now.
        let Some(pid) = std::fs::read_to_string(dir.join(OWNER_PID_FILE))
            .ok()
            .and_then(|p| p.trim().parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // Signal 0 checks existence only; ESRCH: no such process.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A namespace owned by one test. Dropping it deletes the namespace (in the background) and,
/// when the test is failing, prints the control plane's logs.
pub struct TestNamespace {
    pub name: String,
    pub client: kube::Client,
    cluster: &'static ControlPlane,
}

impl TestNamespace {
    pub fn cluster(&self) -> &'static ControlPlane {
        self.cluster
    }

    /// `kubectl` with the cluster's kubeconfig and `-n <this namespace>`.
    pub fn kubectl(&self) -> Command {
        let mut cmd = self.cluster.kubectl();
        cmd.arg("-n").arg(&self.name);
        cmd
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "test in namespace {} failed; control plane logs:\n{}",
                self.name,
                self.cluster.logs_tail(60)
            );
        }
        let _ = self
            .cluster
            .kubectl()
            .args(["delete", "namespace", &self.name, "--wait=false"])
            .output();
    }
}

/// The Pod Security Admission label every test namespace (and the demo's) carries: the real API
/// server refuses a pod that breaks the restricted standard, so stoker's decoders, its injected
/// sidecar and the tests' trainers run as they must on a hardened cluster.
pub const POD_SECURITY_ENFORCE: &str = "pod-security.kubernetes.io/enforce";

/// `pod-security.kubernetes.io/enforce: restricted`, for a namespace's labels.
pub fn restricted_namespace_labels() -> std::collections::BTreeMap<String, String> {
    [(POD_SECURITY_ENFORCE.to_string(), "restricted".to_string())].into()
}

/// The pod-level `securityContext` of a test trainer under the restricted standard: a non-root
/// user (`uid`, its group too) and the runtime's default seccomp profile.
pub fn restricted_pod_security(uid: i64) -> serde_json::Value {
    serde_json::json!({
        "runAsNonRoot": true,
        "runAsUser": uid,
        "runAsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    })
}

/// The container-level `securityContext` the restricted standard requires of every container
/// (it has no pod-level form): no privilege escalation, every capability dropped.
pub fn restricted_container_security() -> serde_json::Value {
    serde_json::json!({
        "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]},
    })
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pem_to_der(pem: &str) -> Result<Vec<u8>> {
    use base64::Engine;
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    Ok(base64::engine::general_purpose::STANDARD.decode(body)?)
}

/// Every pod matching a label selector that has existed since [`PodsEverSeen::watch`]: a scale
/// that creates more pods than it needs and deletes the surplus shows here, not in a later list.
pub struct PodsEverSeen {
    uids: std::sync::Arc<Mutex<std::collections::BTreeSet<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodsEverSeen {
    /// Starts watching `selector` in `namespace`; returns once the watch has listed what exists.
    pub async fn watch(client: &kube::Client, namespace: &str, selector: &str) -> Self {
        use futures::StreamExt;
        use kube::runtime::watcher::{self, Event, watcher};
        let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
        let config = watcher::Config::default().labels(selector);
        let uids = std::sync::Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        let (listed, ready) = tokio::sync::oneshot::channel();
        let seen = uids.clone();
        let task = tokio::spawn(async move {
            let mut listed = Some(listed);
            let mut events = std::pin::pin!(watcher(api, config));
            while let Some(event) = events.next().await {
                match event {
                    Ok(Event::Apply(p) | Event::InitApply(p) | Event::Delete(p)) => {
                        if let Some(uid) = p.metadata.uid {
                            seen.lock().unwrap_or_else(|e| e.into_inner()).insert(uid);
                        }
                    }
                    Ok(Event::InitDone) => {
                        if let Some(tx) = listed.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(Event::Init) | Err(_) => {}
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .expect("pod watch listed")
            .expect("pod watch running");
        Self { uids, task }
    }

    /// How many distinct pods (by uid) have existed.
    pub fn count(&self) -> usize {
        self.uids.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for PodsEverSeen {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_directories_of_gone_processes_are_removed() {
        let parent = tempfile::tempdir().expect("tempdir");
        let mut exited = Command::new("true").spawn().expect("spawn true");
        let gone = exited.id();
        exited.wait().expect("wait");
        let make = |name: &str, pid: Option<u32>| {
            let dir = parent.path().join(name);
            std::fs::create_dir(&dir).expect("mkdir");
            if let Some(pid) = pid {
                std::fs::write(dir.join(OWNER_PID_FILE), pid.to_string()).expect("pid");
            }
            dir
        };
        let abandoned = make("stoker-cluster-gone", Some(gone));
        let running = make("stoker-cluster-running", Some(std::process::id()));
        let starting = make("stoker-cluster-starting", None);
        let someone_elses = make("other-gone", Some(gone));

        remove_abandoned_dirs(parent.path());

        assert!(!abandoned.exists());
        for kept in [running, starting, someone_elses] {
            assert!(kept.exists(), "{} removed", kept.display());
        }
    }
}
