//! A local node runtime for the test cluster: pods that the real scheduler binds to simulated
//! (KWOK) nodes run in runc from their images, inside one network namespace per node, so the
//! cluster's objects and the running data plane are one system.
//!
//! - Network ([`net`]): namespace `stk<s>-<node>` per node on bridge `stk<s>br`, each node's
//!   veth rate-limited both ways to its NIC speed scaled to this machine
//!   ([`RuntimeOptions::nic_scale`], or [`RuntimeOptions::nic_mbit`] per node). Each node gets
//!   `spec.podCIDR` 10.213.(32s+i).0/24, from which KWOK assigns pod IPs, so the IP in pod status
//!   is the address the pod's processes listen on.
//! - Pods ([`pods`]): one runc container per runnable container ([`oci`], [`runc`]), with its
//!   securityContext and limits as a kubelet applies them, in the node's namespace, bound to the
//!   pod IP (`POD_IP`; `0.0.0.0:PORT` in args and env is rewritten to `$POD_IP:PORT`),
//!   restarted per `restartPolicy`, stopped (SIGTERM, grace, SIGKILL) when the pod is deleted.
//!   stoker's loader runs from stoker's image ([`stoker_image_source`]); other images from what
//!   [`RuntimeOptions::images`] maps them to. Host-process mode (no container) only where a test
//!   says why.
//! - The Kubernetes API inside every node namespace: a TCP proxy on the API server's own
//!   loopback address and port. A container authenticates with its projected service-account
//!   token as on a cluster; a host process gets the cluster's admin kubeconfig (`KUBECONFIG`).
//! - S3 ([`NodeRuntime::start_s3`]): the in-process S3 server inside namespace `stk<s>-s3`, so
//!   that GETs cross the nodes' NICs.
//! - Metrics ([`exporter`]): node-exporter's NIC counters per node on root loopback
//!   (`/nodes/<node>/metrics`), and Prometheus file_sd files for the nodes and for every
//!   running loader process (see [`crate::prometheus`]).
//!
//! Needs root (network namespaces). Everything the runtime creates is removed when it is
//! dropped or [`NodeRuntime::shutdown`]; what a killed runtime left is removed by the next one.
//!
//! One runtime per control plane, started right after it (pods created earlier got pod IPs
//! outside the nodes' CIDRs and are not run). The demo:
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use stoker_testenv::cluster::{ControlPlane, Options};
//! use stoker_testenv::prometheus::{Prometheus, PrometheusOptions};
//! use stoker_testenv::runtime::{ImageConfig, ImageMapping, ImageSource, NodeRuntime, RuntimeOptions};
//! use stoker_testenv::s3::S3ServerConfig;
//! use std::time::Duration;
//!
//! let cp = ControlPlane::start(Options::default())?;
//! let runtime = NodeRuntime::start(&cp, RuntimeOptions {
//!     // stoker-loader: from target/image/*.tar (scripts/image.sh), else a root filesystem of
//!     // $STOKER_LOADER_BIN or target/<profile>/stoker-loader
//!     // A trainer image: this machine's Python in runc (the demo's is `trainer_image`).
//!     images: vec![ImageMapping::container("*my-trainer*", ImageSource::HostRootfs {
//!         binds: vec!["/opt/train".into()],
//!         writable: Vec::new(),
//!         config: ImageConfig {
//!             entrypoint: vec!["python3".into(), "/opt/train/train.py".into()],
//!             ..ImageConfig::default()
//!         },
//!     })],
//!     ..RuntimeOptions::default()
//! })?;
//! let s3 = runtime.start_s3(S3ServerConfig::new("/tmp/stoker-demo-s3"))?;
//! // DataPipeline spec.source.s3.endpoint = s3.endpoint() (http://10.213.31.1:PORT)
//! let prometheus = Prometheus::start(PrometheusOptions {
//!     scrape_interval: Duration::from_secs(2),
//!     ..PrometheusOptions::new(runtime.sd_dir())
//! })?;
//! // the operator reads prometheus.url()
//! # Ok(()) }
//! ```
//!
//! An e2e test on the shared control plane:
//! `let rt = NodeRuntime::shared(RuntimeOptions::default);`
//! `let prom = Prometheus::shared(|| PrometheusOptions::new(rt.sd_dir()));`

pub mod exporter;
pub mod image;
pub mod net;
pub mod oci;
pub mod pods;
pub mod runc;
pub mod volume;

use crate::cluster::ControlPlane;
use crate::s3::{S3Server, S3ServerConfig};
use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
pub use image::{ImageConfig, ImageSource, ImageStore};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use net::{Bridge, NetNode, Slot};
pub use pods::ImageMapping;
use pods::{Launch, LoaderTarget, PodRun};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How to run a cluster's pods.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// The `stoker-loader` binary (host-process mode, and the stand-in image before
    /// `scripts/image.sh` has built stoker's image).
    pub loader_bin: PathBuf,
    /// stoker's images (operator and loader); `*` matches any run of characters.
    pub loader_image: String,
    /// How containers of `loader_image` run. `None`: in runc from stoker's image, as on a
    /// cluster ([`stoker_image_source`]); host-process mode only for a test that says why.
    pub loader: Option<ImageSource>,
    /// Other images and the local commands that run them.
    pub images: Vec<ImageMapping>,
    /// NIC speed here = the node's `nic_gbps` × 1000 × `nic_scale` Mbit/s (0.04: 25 Gb/s → 1 Gb/s).
    pub nic_scale: f64,
    /// Per-node NIC speed in Mbit/s, overriding `nic_scale` (e.g. one node with a tiny NIC).
    pub nic_mbit: BTreeMap<String, u32>,
    /// NIC of the S3 namespace in Mbit/s; `None`: unlimited (S3 itself is rarely the limit).
    pub s3_mbit: Option<u32>,
    /// Cap on a pod's termination grace period.
    pub max_grace: Duration,
    /// Logs, volumes and discovery files. `None`: a temporary directory.
    pub dir: Option<PathBuf>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            loader_bin: default_loader_bin(),
            loader_image: "*stoker-loader*".into(),
            loader: None,
            images: Vec::new(),
            nic_scale: 0.04,
            nic_mbit: BTreeMap::new(),
            s3_mbit: None,
            max_grace: Duration::from_secs(10),
            dir: None,
        }
    }
}

/// `$STOKER_LOADER_BIN`, else `stoker-loader` in the current executable's directory or the one
/// above it (`target/debug/deps/<test>` → `target/debug/stoker-loader`).
pub fn default_loader_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("STOKER_LOADER_BIN") {
        return PathBuf::from(bin);
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/debug"));
    let here = exe_dir.join("stoker-loader");
    match exe_dir.parent() {
        Some(up) if !here.exists() => up.join("stoker-loader"),
        _ => here,
    }
}

/// stoker's OCI image built by `scripts/image.sh`: `$STOKER_IMAGE_ARCHIVE`, else the newest
/// `*.tar` under `target/image/` (found from the current executable like the loader binary).
pub fn default_stoker_image() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("STOKER_IMAGE_ARCHIVE") {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let target = exe
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "target"))
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("target"));
    std::fs::read_dir(target.join("image"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "tar"))
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
}

/// stoker's loader in runc: from stoker's OCI image ([`default_stoker_image`]) when it was
/// built after `loader_bin` (an older image would run older code than the tests were built
/// from), else from a root filesystem of `loader_bin`, its libraries and the CA bundle.
pub fn stoker_image_source(loader_bin: &Path) -> ImageSource {
    let modified = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
    match default_stoker_image() {
        Some(archive) if modified(&archive) >= modified(loader_bin) => ImageSource::Oci(archive),
        found => {
            tracing::info!(
                stale_image = ?found,
                "the loader runs from a root filesystem of {} and its libraries (no image from scripts/image.sh newer than it)",
                loader_bin.display()
            );
            ImageSource::Binaries {
                binaries: vec![loader_bin.to_path_buf()],
                config: ImageConfig::default(),
            }
        }
    }
}

type Nodes = Arc<Vec<(String, NetNode)>>;

struct Worker {
    shutdown: tokio::sync::watch::Sender<bool>,
    thread: std::thread::JoinHandle<()>,
}

/// The running node runtime of one control plane (at most one per control plane: the nodes'
/// pod CIDRs are set once).
pub struct NodeRuntime {
    worker: Mutex<Option<Worker>>,
    nodes: Nodes,
    node_ips: BTreeMap<String, Ipv4Addr>,
    s3: Mutex<Option<Arc<NetNode>>>,
    bridge: Bridge,
    slot: Slot,
    exporter: SocketAddr,
    dir: PathBuf,
    tempdirs: Mutex<Vec<tempfile::TempDir>>,
}

impl NodeRuntime {
    /// Creates the nodes' network, sets their pod CIDRs and starts running their pods.
    ///
    /// Blocking; callable from async code too (the set-up runs on a thread of its own).
    pub fn start(cp: &ControlPlane, options: RuntimeOptions) -> Result<NodeRuntime> {
        std::thread::scope(|s| {
            s.spawn(|| Self::start_blocking(cp, options))
                .join()
                .map_err(|_| anyhow!("node runtime start-up panicked"))?
        })
    }

    fn start_blocking(cp: &ControlPlane, options: RuntimeOptions) -> Result<NodeRuntime> {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("the node runtime needs root (network namespaces, tc)");
        }
        let loader = options
            .loader
            .clone()
            .unwrap_or_else(|| stoker_image_source(&options.loader_bin));
        // Without it every loader pod would fail to start, and a story would only time out.
        let missing = match &loader {
            ImageSource::Binaries { binaries, .. } => {
                binaries.iter().map(PathBuf::as_path).find(|b| !b.is_file())
            }
            ImageSource::HostProcess(command) => command
                .first()
                .map(Path::new)
                .filter(|p| p.is_absolute() && !p.is_file()),
            _ => None,
        };
        if let Some(missing) = missing {
            bail!(
                "{} does not exist: build it first (cargo build -p stoker-loader) or set STOKER_LOADER_BIN",
                missing.display()
            );
        }
        let sims = cp.nodes().to_vec();
        if sims.len() > net::MAX_NODES {
            bail!(
                "{} nodes; the node runtime handles at most {}",
                sims.len(),
                net::MAX_NODES
            );
        }
        let api_port: u16 = cp
            .server()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| anyhow!("API server address {} has no port", cp.server()))?;
        let kubeconfig = cp.kubeconfig_path().to_path_buf();

        let setup = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = setup.block_on(cp.client())?;
        let node_api: Api<Node> = Api::all(client.clone());
        // Pod CIDRs are immutable: a second runtime on this control plane must reuse the slot.
        let existing: Vec<Option<String>> = setup.block_on(async {
            let mut out = Vec::new();
            for sim in &sims {
                let node = node_api.get(&sim.name).await?;
                out.push(node.spec.and_then(|s| s.pod_cidr));
            }
            anyhow::Ok(out)
        })?;
        let wanted = existing
            .iter()
            .flatten()
            .next()
            .map(|cidr| {
                Slot::of_pod_cidr(cidr)
                    .ok_or_else(|| anyhow!("a node already has pod CIDR {cidr}, not the runtime's"))
            })
            .transpose()?;
        let slot = Slot::acquire(wanted)?;
        for (i, cidr) in existing.iter().enumerate() {
            if let Some(cidr) = cidr
                && *cidr != slot.pod_cidr(i + 1)
            {
                bail!(
                    "node {} has pod CIDR {cidr}, expected {}",
                    sims[i].name,
                    slot.pod_cidr(i + 1)
                );
            }
        }

        let mut tempdirs = Vec::new();
        let dir = match &options.dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                d.clone()
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("stoker-runtime-")
                    .tempdir()?;
                let d = t.path().to_path_buf();
                tempdirs.push(t);
                d
            }
        };
        // Memory-backed emptyDirs (the sidecar's shared-memory ring).
        let shm = tempfile::Builder::new()
            .prefix("stoker-runtime-")
            .tempdir_in("/dev/shm")
            .or_else(|_| tempfile::Builder::new().prefix("stoker-shm-").tempdir())?;
        let memory_volumes = shm.path().to_path_buf();
        tempdirs.push(shm);
        let sd_dir = dir.join("sd");
        std::fs::create_dir_all(&sd_dir)?;

        let bridge = Bridge::create(&slot)?;
        let mut nodes = Vec::new();
        let mut node_ips = BTreeMap::new();
        for (i, sim) in sims.iter().enumerate() {
            let mbit = options.nic_mbit.get(&sim.name).copied().unwrap_or_else(|| {
                (f64::from(sim.nic_gbps) * 1000.0 * options.nic_scale)
                    .round()
                    .max(1.0) as u32
            });
            let node = NetNode::create(
                &bridge,
                format!("{}-{}", slot.prefix(), sim.name),
                format!("{}n{}", slot.prefix(), i + 1),
                slot.node_ip(i + 1),
                Some(mbit),
            )
            .with_context(|| format!("network of node {}", sim.name))?;
            node_ips.insert(sim.name.clone(), node.ip);
            nodes.push((sim.name.clone(), node));
        }
        let nodes: Nodes = Arc::new(nodes);

        setup.block_on(async {
            for (i, sim) in sims.iter().enumerate() {
                if existing[i].is_some() {
                    continue;
                }
                let cidr = slot.pod_cidr(i + 1);
                let patch = serde_json::json!({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}});
                node_api
                    .patch(&sim.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .with_context(|| format!("setting pod CIDR of node {}", sim.name))?;
            }
            anyhow::Ok(())
        })?;
        drop(setup);

        // The API server, inside every node namespace, on its own loopback address and port.
        let upstream = SocketAddr::from(([127, 0, 0, 1], api_port));
        let mut proxies = Vec::new();
        for (_, node) in nodes.iter() {
            proxies.push(node.bind(upstream)?);
        }
        let exporter_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let exporter = exporter_listener.local_addr()?;
        let names: Vec<String> = nodes.iter().map(|(n, _)| n.clone()).collect();
        exporter::write_node_targets(&sd_dir.join("nodes.json"), &exporter.to_string(), &names)?;
        exporter::write_loader_targets(&sd_dir.join("loaders.json"), &[])?;

        runc::become_subreaper()?;
        let runc_root = PathBuf::from("/run/stoker-runc").join(slot.prefix());
        // Containers a killed runtime of this slot left behind.
        runc::remove_all(&runc_root);
        let cgroup_parent = format!("/stoker/{}", slot.prefix());
        runc::remove_cgroup(&cgroup_parent);
        let launch = Launch {
            loader,
            loader_image: options.loader_image.clone(),
            images: options.images.clone(),
            store: Arc::new(ImageStore::new(ImageStore::default_dir())),
            kubeconfig: kubeconfig.clone(),
            api_port,
            logs: dir.join("logs"),
            volumes: dir.join("volumes"),
            memory_volumes,
            runc_root,
            bundles: dir.join("bundles"),
            cgroup_parent,
            max_grace: options.max_grace,
        };
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let worker_nodes = nodes.clone();
        let sd_file = sd_dir.join("loaders.json");
        let thread = std::thread::Builder::new()
            .name("stoker-node-runtime".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(err) => {
                        let _ = ready_tx.send(Err(err.into()));
                        return;
                    }
                };
                rt.block_on(async move {
                    let client = match client_from(&kubeconfig).await {
                        Ok(c) => c,
                        Err(err) => {
                            let _ = ready_tx.send(Err(err));
                            return;
                        }
                    };
                    let mut tasks = Vec::new();
                    for listener in proxies {
                        tasks.push(tokio::spawn(proxy(listener, upstream)));
                    }
                    let exporter_listener = exporter_listener
                        .set_nonblocking(true)
                        .and_then(|()| tokio::net::TcpListener::from_std(exporter_listener));
                    match exporter_listener {
                        Ok(l) => tasks.push(tokio::spawn(exporter::serve(l, worker_nodes.clone()))),
                        Err(err) => {
                            let _ = ready_tx.send(Err(err.into()));
                            return;
                        }
                    }
                    let _ = ready_tx.send(Ok(()));
                    supervise(client, launch, worker_nodes, sd_file, shutdown_rx).await;
                    for t in tasks {
                        t.abort();
                    }
                });
            })?;
        let runtime = NodeRuntime {
            worker: Mutex::new(Some(Worker { shutdown, thread })),
            nodes,
            node_ips,
            s3: Mutex::new(None),
            bridge,
            slot,
            exporter,
            dir,
            tempdirs: Mutex::new(tempdirs),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(runtime),
            Ok(Err(err)) => Err(err.context("starting the node runtime")),
            Err(_) => bail!("the node runtime's thread ended during start-up"),
        }
    }

    /// The runtime of [`ControlPlane::shared`], started on first use with `options()`, stopped
    /// (network removed) when the process exits.
    pub fn shared(options: impl FnOnce() -> RuntimeOptions) -> &'static NodeRuntime {
        static SHARED: OnceLock<Result<NodeRuntime, String>> = OnceLock::new();
        extern "C" fn stop_shared() {
            if let Some(Ok(rt)) = SHARED.get() {
                rt.shutdown();
            }
        }
        let result = SHARED.get_or_init(|| {
            let started =
                NodeRuntime::start(ControlPlane::shared(), options()).map_err(|e| format!("{e:#}"));
            if started.is_ok() {
                // SAFETY: registers a plain function to run at exit.
                unsafe { libc::atexit(stop_shared) };
            }
            started
        });
        match result {
            Ok(rt) => rt,
            Err(e) => panic!("node runtime failed to start: {e}"),
        }
    }

    /// Starts the S3 server inside the S3 namespace (`stk<s>-s3`, 10.213.(32s+31).1); its
    /// endpoint is reachable from every node and from the root namespace.
    pub fn start_s3(&self, config: S3ServerConfig) -> Result<S3Server> {
        let node = {
            let mut s3 = self.s3.lock().unwrap_or_else(|e| e.into_inner());
            match &*s3 {
                Some(n) => n.clone(),
                None => {
                    let n = Arc::new(NetNode::create(
                        &self.bridge,
                        format!("{}-s3", self.slot.prefix()),
                        format!("{}s3", self.slot.prefix()),
                        self.slot.s3_ip(),
                        None,
                    )?);
                    *s3 = Some(n.clone());
                    n
                }
            }
        };
        let listener = node.bind(SocketAddr::from((node.ip, config.port)))?;
        S3Server::start_on(config, listener)
    }

    /// The simulated nodes' names, in index order.
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|(n, _)| n.clone()).collect()
    }

    fn node(&self, name: &str) -> Result<&NetNode> {
        self.nodes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, node)| node)
            .ok_or_else(|| anyhow!("no simulated node {name}"))
    }

    /// The network namespace of a node, for `ip netns exec`.
    pub fn netns(&self, node: &str) -> Result<String> {
        Ok(self.node(node)?.netns.clone())
    }

    /// The node namespace's own address (its `eth0`).
    pub fn node_ip(&self, node: &str) -> Option<Ipv4Addr> {
        self.node_ips.get(node).copied()
    }

    /// The NIC limit of a node, Mbit/s each way.
    pub fn nic_mbit(&self, node: &str) -> Result<u32> {
        self.node(node)?
            .mbit
            .ok_or_else(|| anyhow!("node {node} has no NIC limit"))
    }

    /// A TCP listener inside a node's namespace (for tests that measure the NIC).
    pub fn bind(&self, node: &str, addr: SocketAddr) -> Result<std::net::TcpListener> {
        self.node(node)?.bind(addr)
    }

    /// Bytes (received, transmitted) by a node's NIC so far.
    pub fn nic_counters(&self, node: &str) -> Result<(u64, u64)> {
        self.node(node)?.counters()
    }

    /// `http://127.0.0.1:PORT/nodes/<node>/metrics`: the node's node-exporter NIC metrics.
    pub fn node_metrics_url(&self, node: &str) -> String {
        format!("http://{}/nodes/{node}/metrics", self.exporter)
    }

    /// The root namespace's address on the nodes' bridge: a service started here on this
    /// address (Prometheus, for an operator running as a pod) is reachable from every pod.
    pub fn host_ip(&self) -> Ipv4Addr {
        self.slot.bridge_ip()
    }

    /// Prometheus file_sd files: `nodes.json` (node exporters) and `loaders.json` (loaders).
    pub fn sd_dir(&self) -> PathBuf {
        self.dir.join("sd")
    }

    /// The cgroup of a runc container, relative to the hierarchies' roots.
    pub fn container_cgroup(&self, pod_uid: &str, container: &str) -> String {
        format!("/stoker/{}/{pod_uid}/{container}", self.slot.prefix())
    }

    /// CPU time a running runc container has used (its cgroup's `cpuacct.usage` on cgroup
    /// v1, `cpu.stat` on v2).
    pub fn container_cpu(&self, pod_uid: &str, container: &str) -> Option<Duration> {
        runc::cpu_usage(&self.container_cgroup(pod_uid, container))
    }

    /// Where each container's output goes (`<namespace>_<pod>_<container>[.<restart>].log`).
    pub fn logs_dir(&self) -> PathBuf {
        self.dir.join("logs")
    }

    /// The last lines of a container's log (its latest run).
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> String {
        let base = format!("{namespace}_{pod}_{container}");
        let latest = std::fs::read_dir(self.logs_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name == format!("{base}.log") || name.starts_with(&format!("{base}."))
            })
            .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok());
        latest
            .map(|e| crate::process::tail(&e.path(), 60))
            .unwrap_or_default()
    }

    /// Stops every pod process, then removes the namespaces, veths and bridge. Idempotent.
    pub fn shutdown(&self) {
        let worker = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(worker) = worker {
            let _ = worker.shutdown.send(true);
            let _ = worker.thread.join();
        }
        for (_, node) in self.nodes.iter() {
            node.remove();
        }
        if let Some(s3) = self.s3.lock().unwrap_or_else(|e| e.into_inner()).take() {
            s3.remove();
        }
        self.bridge.remove();
        self.tempdirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

impl Drop for NodeRuntime {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn client_from(kubeconfig: &Path) -> Result<kube::Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// Forwards every connection to `upstream` (the API server on the root namespace's loopback).
async fn proxy(listener: std::net::TcpListener, upstream: SocketAddr) {
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        tokio::spawn(async move {
            if let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await {
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

type Key = (String, String);

/// The pod's IP when the pod should run on one of `nodes` now.
fn runnable(pod: &Pod, nodes: &Nodes) -> Option<(usize, Ipv4Addr)> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let node_name = pod.spec.as_ref()?.node_name.as_deref()?;
    let index = nodes.iter().position(|(n, _)| n == node_name)?;
    let ip: Ipv4Addr = status.pod_ip.as_deref()?.parse().ok()?;
    Some((index, ip))
}

fn in_pod_cidr(node: &NetNode, ip: Ipv4Addr) -> bool {
    node.ip.octets()[..3] == ip.octets()[..3]
}

async fn supervise(
    client: kube::Client,
    launch: Launch,
    nodes: Nodes,
    sd_file: PathBuf,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let launch = Arc::new(launch);
    let api: Api<Pod> = Api::all(client.clone());
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut desired: BTreeMap<Key, Pod> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<Key, Pod>> = None;
    let mut running: BTreeMap<Key, (usize, PodRun)> = BTreeMap::new();
    // Pods that failed to prepare (a missing Secret, say): uid and when to try again.
    let mut retry_at: BTreeMap<Key, (String, Instant)> = BTreeMap::new();
    let mut warned: BTreeSet<String> = BTreeSet::new();
    let mut last_targets: Option<Vec<LoaderTarget>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let key = |p: &Pod| {
        (
            p.metadata.namespace.clone().unwrap_or_default(),
            p.metadata.name.clone().unwrap_or_default(),
        )
    };
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            event = events.next() => match event {
                Some(Ok(watcher::Event::Apply(p))) => { desired.insert(key(&p), p); }
                Some(Ok(watcher::Event::Delete(p))) => { desired.remove(&key(&p)); }
                Some(Ok(watcher::Event::Init)) => relisting = Some(BTreeMap::new()),
                Some(Ok(watcher::Event::InitApply(p))) => {
                    if let Some(r) = relisting.as_mut() { r.insert(key(&p), p); }
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    if let Some(r) = relisting.take() { desired = r; }
                }
                Some(Err(err)) => tracing::warn!(%err, "watching pods"),
                None => break,
            },
            _ = tick.tick() => {}
        }

        let gone: Vec<Key> = running
            .iter()
            .filter(|(k, (_, run))| match desired.get(*k) {
                None => true,
                Some(p) => {
                    runnable(p, &nodes).is_none()
                        || p.metadata.uid.as_deref() != Some(run.uid.as_str())
                }
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            if let Some((_, run)) = running.remove(&k) {
                let launch = launch.clone();
                tokio::task::spawn_blocking(move || run.stop(&launch));
            }
        }

        for (k, pod) in &desired {
            if running.contains_key(k) {
                continue;
            }
            let Some((index, ip)) = runnable(pod, &nodes) else {
                continue;
            };
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            if let Some((failed_uid, at)) = retry_at.get(k)
                && *failed_uid == uid
                && Instant::now() < *at
            {
                continue;
            }
            let node = &nodes[index].1;
            if !in_pod_cidr(node, ip) {
                if warned.insert(uid) {
                    tracing::warn!(pod = ?k, %ip, "pod IP is outside its node's pod CIDR (pod created before the runtime started?); not run");
                }
                continue;
            }
            let prepared = match PodRun::prepare(&client, &launch, pod, ip).await {
                // A pod with nothing to run here needs no address either.
                Ok(run) if run.is_empty() => Ok(run),
                Ok(run) => node.add_address(ip).map(|()| run),
                Err(err) => Err(err),
            };
            match prepared {
                Ok(run) => {
                    retry_at.remove(k);
                    running.insert(k.clone(), (index, run));
                }
                Err(err) => {
                    tracing::warn!(pod = ?k, err = format!("{err:#}"), "pod not started; retrying in 2s");
                    retry_at.insert(k.clone(), (uid, Instant::now() + Duration::from_secs(2)));
                }
            }
        }
        retry_at.retain(|k, _| desired.contains_key(k));

        for (k, (index, run)) in running.iter_mut() {
            run.sync_volumes(&client).await;
            run.supervise(&nodes[*index].1, &launch);
            let Some(pod) = desired.get(k) else {
                continue;
            };
            if let Some(patch) = run.status_patch(pod) {
                let pods: Api<Pod> = Api::namespaced(client.clone(), &k.0);
                if let Err(err) = pods
                    .patch_status(&k.1, &PatchParams::default(), &Patch::Strategic(&patch))
                    .await
                {
                    tracing::warn!(pod = ?k, %err, "updating pod status");
                    run.status_not_reported();
                }
            }
        }

        let mut targets: Vec<LoaderTarget> = running
            .values()
            .flat_map(|(_, run)| run.loader_targets())
            .collect();
        targets.sort();
        if last_targets.as_ref() != Some(&targets) {
            if let Err(err) = exporter::write_loader_targets(&sd_file, &targets) {
                tracing::warn!(err = format!("{err:#}"), "writing loader targets");
            }
            last_targets = Some(targets);
        }
    }

    let stopping: Vec<_> = std::mem::take(&mut running)
        .into_values()
        .map(|(_, run)| {
            let launch = launch.clone();
            tokio::task::spawn_blocking(move || run.stop(&launch))
        })
        .collect();
    for s in stopping {
        let _ = s.await;
    }
    let _ = exporter::write_loader_targets(&sd_file, &[]);
    runc::remove_cgroup(&launch.cgroup_parent);
}
