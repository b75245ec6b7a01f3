//! What a kubelet would do for the simulated nodes, with local processes instead of containers.
//!
//! A pod bound to one of the runtime's nodes, once KWOK has given it an IP from the node's pod
//! CIDR, gets that IP on the node namespace's `eth0` and one process per container it knows how
//! to run ([`Launch`]): the loader image runs the local `stoker-loader` binary, other images run
//! the command the caller mapped them to. Pods on one node share the node's namespace, so the
//! runtime makes each process bind its pod's IP: it sets `POD_IP`, rewrites `0.0.0.0:PORT` in
//! args and env values to `$POD_IP:PORT`, and gives the loader `STOKER_GRPC_ADDR` and
//! `STOKER_HTTP_ADDR` on the pod IP. Volumes (configMap, secret, emptyDir) are directories under
//! the runtime's directory, and args and env values that name a mount path are rewritten to
//! that directory. Env comes from `env` (values, `$(VAR)` references, fieldRef, secretKeyRef,
//! configMapKeyRef) and `envFrom`, on top of the runtime's own environment.
//!
//! Pod status follows the processes: restart counts, the last exit code, Ready from the
//! process being up and its HTTP readiness probe (if any) passing, and Succeeded/Failed once
//! every process of a pod that does not restart has ended. Native sidecars (init containers
//! with `restartPolicy: Always`) run beside the containers and, as the kubelet does, are sent
//! SIGTERM once every regular container has ended; the phase then follows the regular
//! containers' exit codes. Not run: ordinary init containers, exec/TCP and startup/liveness probes,
//! resource limits. A stopped pod's address stays on `eth0` until the runtime stops (KWOK may
//! give it to the next pod of the node, which then reuses it).

use super::net::NetNode;
use anyhow::{Context, Result, anyhow};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::Api;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::process::Component;

/// Which local command runs a container image.
#[derive(Clone, Debug)]
pub struct ImageMapping {
    /// Image pattern; `*` matches any run of characters.
    pub image: String,
    /// Program and leading arguments; the container's `args` follow. Empty: run the container's
    /// own `command` and `args` on this machine (for tests).
    pub command: Vec<String>,
}

impl ImageMapping {
    pub fn new(
        image: impl Into<String>,
        command: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            image: image.into(),
            command: command.into_iter().map(Into::into).collect(),
        }
    }

    /// Images matching `image` run their container's `command` + `args` as they are.
    pub fn host_command(image: impl Into<String>) -> Self {
        Self {
            image: image.into(),
            command: Vec::new(),
        }
    }
}

/// `*` wildcards only.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

/// What the supervisor needs to know to turn containers into processes.
pub struct Launch {
    pub loader_bin: PathBuf,
    pub loader_image: String,
    pub images: Vec<ImageMapping>,
    /// KUBECONFIG for processes (the API server is proxied into every node namespace on the
    /// same loopback address and port).
    pub kubeconfig: PathBuf,
    pub logs: PathBuf,
    pub volumes: PathBuf,
    pub memory_volumes: PathBuf,
    pub max_grace: Duration,
}

/// A loader process Prometheus should scrape.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LoaderTarget {
    pub address: String,
    pub pod: String,
    pub namespace: String,
    pub node: String,
    pub container: String,
    pub role: String,
    pub pipeline: String,
}

struct ContainerRun {
    name: String,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    loader: bool,
    /// A native sidecar: restarts whatever the pod's policy, ends with the regular containers.
    sidecar: bool,
    /// SIGTERM sent because the regular containers ended: its exit is final.
    stopping: bool,
    metrics_port: u16,
    readiness: Option<Readiness>,
    process: Option<Component>,
    restarts: u32,
    started: Instant,
    next_start: Instant,
    backoff: Duration,
    finished: bool,
    /// Exit code of the last run (128 + signal when killed).
    last_exit: Option<i32>,
}

/// What a container's process is doing, as last reported in pod status.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ContainerReport {
    name: String,
    sidecar: bool,
    restarts: u32,
    running: bool,
    ready: bool,
    finished: bool,
    last_exit: Option<i32>,
}

pub struct PodRun {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
    pub ip: Ipv4Addr,
    labels: BTreeMap<String, String>,
    restart_policy: String,
    grace: Duration,
    dirs: Vec<PathBuf>,
    containers: Vec<ContainerRun>,
    reported: Option<Vec<ContainerReport>>,
}

const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A process that ran this long before exiting restarts without backoff.
const BACKOFF_RESET: Duration = Duration::from_secs(10);

fn pod_key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

impl PodRun {
    pub fn key(&self) -> (String, String) {
        (self.namespace.clone(), self.name.clone())
    }

    /// Builds every runnable container of `pod` (volumes written, env resolved) without
    /// starting anything. Containers whose image maps to nothing are skipped with a log line.
    pub async fn prepare(
        client: &kube::Client,
        launch: &Launch,
        pod: &Pod,
        ip: Ipv4Addr,
    ) -> Result<PodRun> {
        let (namespace, name) = pod_key(pod);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let spec = pod
            .spec
            .as_ref()
            .ok_or_else(|| anyhow!("pod has no spec"))?;
        let node = spec.node_name.clone().unwrap_or_default();
        let sidecars = spec
            .init_containers
            .iter()
            .flatten()
            .filter(|c| c.restart_policy.as_deref() == Some("Always"));
        let mut runnable = Vec::new();
        let regular = spec.containers.iter().map(|c| (c, false));
        for (c, sidecar) in sidecars.map(|c| (c, true)).chain(regular) {
            let image = c.image.clone().unwrap_or_default();
            let loader = glob_match(&launch.loader_image, &image);
            // What the runtime puts first (`host_words` of it) is a path on this machine, never
            // rewritten into a mount: a checkout under /tmp would land in the pod's /tmp volume.
            let (mut command, host_words): (Vec<String>, usize) = if loader {
                (vec![launch.loader_bin.display().to_string()], 1)
            } else if let Some(m) = launch.images.iter().find(|m| glob_match(&m.image, &image)) {
                if m.command.is_empty() {
                    (c.command.clone().unwrap_or_default(), 0)
                } else {
                    (m.command.clone(), m.command.len())
                }
            } else {
                tracing::debug!(pod = %name, container = %c.name, %image, "no local command for this image; not run");
                continue;
            };
            command.extend(c.args.clone().unwrap_or_default());
            if command.is_empty() {
                tracing::warn!(pod = %name, container = %c.name, "empty command; not run");
                continue;
            }
            runnable.push((c, sidecar, loader, command, host_words));
        }
        // Only what the runnable containers mount (pods of other images cost nothing).
        let mounted: std::collections::BTreeSet<&str> = runnable
            .iter()
            .flat_map(|(c, _, _, _, _)| c.volume_mounts.iter().flatten())
            .map(|m| m.name.as_str())
            .collect();
        let pod_dir = format!("{namespace}_{name}_{}", &uid[..uid.len().min(8)]);
        let mut dirs = Vec::new();
        let mut volumes: BTreeMap<String, PathBuf> = BTreeMap::new();
        for volume in spec
            .volumes
            .iter()
            .flatten()
            .filter(|v| mounted.contains(v.name.as_str()))
        {
            let memory =
                volume.empty_dir.as_ref().and_then(|e| e.medium.as_deref()) == Some("Memory");
            let base = if memory {
                &launch.memory_volumes
            } else {
                &launch.volumes
            };
            let dir = base.join(&pod_dir).join(&volume.name);
            std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
            if !dirs.contains(&base.join(&pod_dir)) {
                dirs.push(base.join(&pod_dir));
            }
            if let Some(cm) = &volume.config_map {
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
                let found = api.get_opt(&cm.name).await?;
                let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                if let Some(found) = found {
                    for (k, v) in found.data.unwrap_or_default() {
                        files.insert(k, v.into_bytes());
                    }
                    for (k, v) in found.binary_data.unwrap_or_default() {
                        files.insert(k, v.0);
                    }
                } else if cm.optional != Some(true) {
                    anyhow::bail!("configmap {namespace}/{} not found", cm.name);
                }
                write_volume(&dir, files, cm.items.as_deref())?;
            } else if let Some(secret) = &volume.secret {
                let secret_name = secret.secret_name.clone().unwrap_or_default();
                let api: Api<Secret> = Api::namespaced(client.clone(), &namespace);
                let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                match api.get_opt(&secret_name).await? {
                    Some(found) => {
                        for (k, v) in found.data.unwrap_or_default() {
                            files.insert(k, v.0);
                        }
                        for (k, v) in found.string_data.unwrap_or_default() {
                            files.insert(k, v.into_bytes());
                        }
                    }
                    None if secret.optional == Some(true) => {}
                    None => anyhow::bail!("secret {namespace}/{secret_name} not found"),
                }
                write_volume(&dir, files, secret.items.as_deref())?;
            } else if volume.projected.is_some() {
                // The service-account token volume: processes use KUBECONFIG instead.
                tracing::debug!(pod = %name, volume = %volume.name, "projected volume left empty");
            } else if volume.empty_dir.is_none() {
                tracing::warn!(pod = %name, volume = %volume.name, "volume kind not supported by the node runtime; an empty directory stands in");
            }
            volumes.insert(volume.name.clone(), dir);
        }

        let mut containers = Vec::new();
        for (c, sidecar, loader, command, host_words) in runnable {
            let mounts = mounts_of(c, &volumes);
            let metrics_port = metrics_port(c);
            let readiness = Readiness::of(c);
            let mut env = resolve_env(client, pod, c, ip).await?;
            let mut extra = vec![
                ("POD_IP".to_string(), ip.to_string()),
                ("HOSTNAME".to_string(), name.clone()),
                (
                    "KUBECONFIG".to_string(),
                    launch.kubeconfig.display().to_string(),
                ),
            ];
            if loader {
                extra.push(("STOKER_HTTP_ADDR".into(), format!("{ip}:{metrics_port}")));
                extra.push(("STOKER_GRPC_ADDR".into(), format!("{ip}:50051")));
            }
            for (k, v) in extra {
                if !env.iter().any(|(name, _)| *name == k) {
                    env.push((k, v));
                }
            }
            let vars: BTreeMap<String, String> = env.iter().cloned().collect();
            let rewrite = |s: &str| rewrite_value(&expand_vars(s, &vars), ip, &mounts);
            let env = env.iter().map(|(k, v)| (k.clone(), rewrite(v))).collect();
            let mut command = command.iter().enumerate().map(|(i, a)| {
                if i < host_words {
                    a.clone()
                } else {
                    rewrite(a)
                }
            });
            let program = command.next().unwrap_or_default();
            let now = Instant::now();
            containers.push(ContainerRun {
                name: c.name.clone(),
                program,
                args: command.collect(),
                env,
                loader,
                sidecar,
                stopping: false,
                metrics_port,
                readiness,
                process: None,
                restarts: 0,
                started: now,
                next_start: now,
                backoff: BACKOFF_START,
                finished: false,
                last_exit: None,
            });
        }
        let grace = spec
            .termination_grace_period_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(Duration::from_secs(30))
            .min(launch.max_grace);
        Ok(PodRun {
            namespace,
            name,
            uid,
            node,
            ip,
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            restart_policy: spec
                .restart_policy
                .clone()
                .unwrap_or_else(|| "Always".into()),
            grace,
            dirs,
            containers,
            reported: None,
        })
    }

    /// No container of the pod runs here (no local command for its images).
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// Starts containers that are due: not yet started, or exited and due for a restart under
    /// the pod's restart policy.
    pub fn supervise(&mut self, netns: &NetNode, launch: &Launch) {
        let now = Instant::now();
        let regular_ended = self.containers.iter().any(|c| !c.sidecar)
            && self.containers.iter().all(|c| c.sidecar || c.finished);
        for c in &mut self.containers {
            if c.finished {
                continue;
            }
            if regular_ended && !c.stopping {
                c.stopping = true;
                match &c.process {
                    // SAFETY: kill(2) on a process this runtime started.
                    Some(p) => unsafe {
                        libc::kill(p.pid() as libc::pid_t, libc::SIGTERM);
                    },
                    None => c.finished = true,
                }
                continue;
            }
            if let Some(p) = &mut c.process {
                let Some(status) = p.exited() else {
                    if let Some(r) = &mut c.readiness {
                        r.probe(self.ip, now);
                    }
                    continue;
                };
                c.process = None;
                if let Some(r) = &mut c.readiness {
                    r.reset();
                }
                c.last_exit = Some(
                    status
                        .code()
                        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
                );
                let restart = match self.restart_policy.as_str() {
                    _ if c.stopping => false,
                    _ if c.sidecar => true,
                    "Never" => false,
                    "OnFailure" => !status.success(),
                    _ => true,
                };
                tracing::info!(pod = %self.name, container = %c.name, %status, restart, "container exited");
                if !restart {
                    c.finished = true;
                    continue;
                }
                if now.duration_since(c.started) >= BACKOFF_RESET {
                    c.backoff = BACKOFF_START;
                }
                c.next_start = now + c.backoff;
                c.backoff = (c.backoff * 2).min(BACKOFF_MAX);
                c.restarts += 1;
                continue;
            }
            if now < c.next_start {
                continue;
            }
            let mut args = vec![
                "netns".to_string(),
                "exec".into(),
                netns.netns.clone(),
                "env".into(),
            ];
            args.extend(
                c.env
                    .iter()
                    .filter(|(k, _)| !k.is_empty() && !k.contains('='))
                    .map(|(k, v)| format!("{k}={v}")),
            );
            args.push(c.program.clone());
            args.extend(c.args.iter().cloned());
            let log_name = if c.restarts == 0 {
                format!("{}_{}_{}", self.namespace, self.name, c.name)
            } else {
                format!("{}_{}_{}.{}", self.namespace, self.name, c.name, c.restarts)
            };
            match Component::start(&log_name, Path::new("ip"), &args, &launch.logs) {
                Ok(p) => {
                    tracing::info!(pod = %self.name, container = %c.name, pid = p.pid(), node = %self.node, ip = %self.ip, "container started");
                    c.process = Some(p);
                    c.started = now;
                }
                Err(err) => {
                    tracing::warn!(pod = %self.name, container = %c.name, %err, "container failed to start");
                    c.next_start = now + c.backoff;
                    c.backoff = (c.backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    fn report(&self) -> Vec<ContainerReport> {
        self.containers
            .iter()
            .map(|c| ContainerReport {
                name: c.name.clone(),
                sidecar: c.sidecar,
                restarts: c.restarts,
                running: c.process.is_some(),
                ready: c.process.is_some() && c.readiness.as_ref().is_none_or(Readiness::ok),
                finished: c.finished,
                last_exit: c.last_exit,
            })
            .collect()
    }

    /// A strategic-merge patch of the pod's status when its processes changed since the last
    /// one: restart counts, container states, Ready, and the phase once every process of a
    /// pod that does not restart has ended. KWOK marked the pod Running and Ready when it was
    /// bound; the first report, all running, matches that and patches nothing.
    pub fn status_patch(&mut self, pod: &Pod) -> Option<serde_json::Value> {
        let report = self.report();
        if self.reported.as_ref() == Some(&report) {
            return None;
        }
        let first = self.reported.is_none();
        self.reported = Some(report.clone());
        if first && report.iter().all(|r| r.ready && r.restarts == 0) {
            return None;
        }
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = pod.status.as_ref()?;
        let update = |statuses: &Option<Vec<k8s_openapi::api::core::v1::ContainerStatus>>| {
            let mut list = serde_json::to_value(statuses.clone().unwrap_or_default())
                .unwrap_or_else(|_| serde_json::json!([]));
            for entry in list.as_array_mut().into_iter().flatten() {
                let Some(r) = report
                    .iter()
                    .find(|r| entry["name"].as_str() == Some(r.name.as_str()))
                else {
                    continue;
                };
                entry["restartCount"] = r.restarts.into();
                entry["ready"] = r.ready.into();
                entry["started"] = r.running.into();
                entry["state"] = if r.running {
                    serde_json::json!({"running": {"startedAt": now}})
                } else if r.finished {
                    let code = r.last_exit.unwrap_or(0);
                    let reason = if code == 0 { "Completed" } else { "Error" };
                    serde_json::json!({"terminated": {"exitCode": code, "reason": reason, "finishedAt": now}})
                } else {
                    serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}})
                };
                if let Some(code) = r.last_exit {
                    entry["lastState"] =
                        serde_json::json!({"terminated": {"exitCode": code, "finishedAt": now}});
                }
            }
            list
        };
        let ready = report.iter().all(|r| r.ready);
        let ready = if ready { "True" } else { "False" };
        let mut patch = serde_json::json!({"status": {
            "conditions": [
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": update(&status.container_statuses),
            "initContainerStatuses": update(&status.init_container_statuses),
        }});
        if !report.is_empty() && report.iter().all(|r| r.finished) {
            // Sidecars end by SIGTERM; the pod's outcome is its regular containers'.
            let ok = report
                .iter()
                .filter(|r| !r.sidecar)
                .all(|r| r.last_exit == Some(0));
            patch["status"]["phase"] = if ok { "Succeeded" } else { "Failed" }.into();
        }
        Some(patch)
    }

    /// The last status patch did not land: send the next one whatever it holds.
    pub fn status_not_reported(&mut self) {
        self.reported = Some(Vec::new());
    }

    /// The loader processes of this pod that are running, as scrape targets.
    pub fn loader_targets(&self) -> Vec<LoaderTarget> {
        let label = |k: &str| self.labels.get(k).cloned().unwrap_or_default();
        self.containers
            .iter()
            .filter(|c| c.loader && c.process.is_some())
            .map(|c| LoaderTarget {
                address: format!("{}:{}", self.ip, c.metrics_port),
                pod: self.name.clone(),
                namespace: self.namespace.clone(),
                node: self.node.clone(),
                container: c.name.clone(),
                role: label("stoker.dev/role"),
                pipeline: label("stoker.dev/pipeline"),
            })
            .collect()
    }

    /// SIGTERM to every process of the pod (and their children), SIGKILL after the grace
    /// period; then removes the pod's volumes. Blocking.
    pub fn stop(mut self) {
        let mut all = Vec::new();
        for c in &self.containers {
            if let Some(p) = &c.process {
                let tree = descendants(p.pid());
                for pid in &tree {
                    // SAFETY: kill(2) on processes this runtime started (and their children).
                    unsafe { libc::kill(*pid as libc::pid_t, libc::SIGTERM) };
                }
                all.extend(tree);
            }
        }
        let deadline = Instant::now() + self.grace;
        for c in &mut self.containers {
            if let Some(mut p) = c.process.take() {
                p.stop(deadline.saturating_duration_since(Instant::now()));
            }
        }
        for pid in all {
            // Children that outlived their parent (already reaped pids are gone; a reused pid
            // in this short window is the accepted risk).
            if Path::new(&format!("/proc/{pid}")).exists() {
                // SAFETY: as above.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
        tracing::info!(pod = %self.name, node = %self.node, "pod stopped");
    }
}

/// A container's HTTP readiness probe, run from the root namespace against the pod IP.
struct Readiness {
    port: u16,
    path: String,
    period: Duration,
    next: Instant,
    ok: Arc<AtomicBool>,
    in_flight: Arc<AtomicBool>,
}

impl Readiness {
    /// `readinessProbe.httpGet` over plain HTTP; other probes are not run (the container
    /// counts as ready while its process runs).
    fn of(c: &Container) -> Option<Readiness> {
        let probe = c.readiness_probe.as_ref()?;
        let get = probe.http_get.as_ref()?;
        if get.scheme.as_deref().is_some_and(|s| s != "HTTP") {
            return None;
        }
        let port = match &get.port {
            IntOrString::Int(p) => u16::try_from(*p).ok()?,
            IntOrString::String(name) => c
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(|p| u16::try_from(p.container_port).ok())?,
        };
        Some(Readiness {
            port,
            path: get.path.clone().unwrap_or_else(|| "/".into()),
            period: Duration::from_secs(probe.period_seconds.unwrap_or(10).clamp(1, 10) as u64),
            next: Instant::now(),
            ok: Arc::default(),
            in_flight: Arc::default(),
        })
    }

    fn ok(&self) -> bool {
        self.ok.load(Ordering::SeqCst)
    }

    fn reset(&mut self) {
        self.ok.store(false, Ordering::SeqCst);
        self.next = Instant::now();
    }

    /// Starts a probe when one is due (on the calling tokio runtime).
    fn probe(&mut self, ip: Ipv4Addr, now: Instant) {
        if now < self.next || self.in_flight.swap(true, Ordering::SeqCst) {
            return;
        }
        // Probe often until the first success, then at the pod's period.
        self.next = now
            + if self.ok() {
                self.period
            } else {
                Duration::from_millis(500)
            };
        let (ok, in_flight) = (self.ok.clone(), self.in_flight.clone());
        let addr = std::net::SocketAddr::from((ip, self.port));
        let path = self.path.clone();
        tokio::spawn(async move {
            let result =
                tokio::time::timeout(Duration::from_secs(1), crate::http::get(addr, &path)).await;
            ok.store(
                matches!(result, Ok(Ok((status, _))) if (200..400).contains(&status)),
                Ordering::SeqCst,
            );
            in_flight.store(false, Ordering::SeqCst);
        });
    }
}

fn write_volume(
    dir: &Path,
    files: BTreeMap<String, Vec<u8>>,
    items: Option<&[k8s_openapi::api::core::v1::KeyToPath]>,
) -> Result<()> {
    for (key, body) in files {
        let rel = match items {
            Some(items) => match items.iter().find(|i| i.key == key) {
                Some(item) => item.path.clone(),
                None => continue,
            },
            None => key,
        };
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, body).with_context(|| path.display().to_string())?;
    }
    Ok(())
}

/// (mount path, host directory), longest mount path first.
fn mounts_of(c: &Container, volumes: &BTreeMap<String, PathBuf>) -> Vec<(String, String)> {
    let mut mounts: Vec<(String, String)> = c
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let dir = volumes.get(&m.name)?;
            let dir = match m.sub_path.as_deref() {
                Some(sub) if !sub.is_empty() => dir.join(sub),
                _ => dir.clone(),
            };
            Some((
                m.mount_path.trim_end_matches('/').to_string(),
                dir.display().to_string(),
            ))
        })
        .collect();
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    mounts
}

/// The port named `metrics` (decoders) or `<prefix>-metrics` (the injected sidecar's
/// `stoker-metrics`, prefixed so it never clashes with the trainer's own port names).
fn metrics_port(c: &Container) -> u16 {
    c.ports
        .iter()
        .flatten()
        .find(|p| {
            p.name
                .as_deref()
                .is_some_and(|n| n == "metrics" || n.ends_with("-metrics"))
        })
        .and_then(|p| u16::try_from(p.container_port).ok())
        .unwrap_or(9090)
}

/// `0.0.0.0:` → `<pod ip>:` anywhere, and a leading mount path (also after `--flag=`) → the
/// volume's directory.
pub fn rewrite_value(value: &str, ip: Ipv4Addr, mounts: &[(String, String)]) -> String {
    let value = value.replace("0.0.0.0:", &format!("{ip}:"));
    let (head, path) = match value.split_once('=') {
        Some((flag, rest)) if flag.starts_with('-') => (format!("{flag}="), rest.to_string()),
        _ => (String::new(), value.clone()),
    };
    for (mount, dir) in mounts {
        if path == *mount {
            return format!("{head}{dir}");
        }
        if let Some(rest) = path.strip_prefix(&format!("{mount}/")) {
            return format!("{head}{dir}/{rest}");
        }
    }
    value
}

/// Kubernetes' `$(VAR)` references; `$$` escapes; unknown references stay as they are.
pub fn expand_vars(value: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(close) = tail.strip_prefix("$(").and_then(|t| t.find(')')) {
            let name = &tail[2..2 + close];
            match vars.get(name) {
                Some(v) => out.push_str(v),
                None => out.push_str(&tail[..close + 3]),
            }
            rest = &tail[close + 3..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

async fn resolve_env(
    client: &kube::Client,
    pod: &Pod,
    c: &Container,
    ip: Ipv4Addr,
) -> Result<Vec<(String, String)>> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
        env.retain(|(name, _)| *name != k);
        env.push((k, v));
    };
    for from in c.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        if let Some(r) = &from.secret_ref {
            match secrets.get_opt(&r.name).await? {
                Some(s) => {
                    for (k, v) in s.data.unwrap_or_default() {
                        set(
                            &mut env,
                            format!("{prefix}{k}"),
                            String::from_utf8_lossy(&v.0).into_owned(),
                        );
                    }
                }
                None if r.optional == Some(true) => {}
                None => anyhow::bail!("secret {namespace}/{} (envFrom) not found", r.name),
            }
        }
        if let Some(r) = &from.config_map_ref {
            match config_maps.get_opt(&r.name).await? {
                Some(cm) => {
                    for (k, v) in cm.data.unwrap_or_default() {
                        set(&mut env, format!("{prefix}{k}"), v);
                    }
                }
                None if r.optional == Some(true) => {}
                None => anyhow::bail!("configmap {namespace}/{} (envFrom) not found", r.name),
            }
        }
    }
    for e in c.env.iter().flatten() {
        let vars: BTreeMap<String, String> = env.iter().cloned().collect();
        let value = if let Some(v) = &e.value {
            Some(expand_vars(v, &vars))
        } else if let Some(from) = &e.value_from {
            if let Some(f) = &from.field_ref {
                field_value(pod, &f.field_path, ip)
            } else if let Some(k) = &from.secret_key_ref {
                let found = secrets.get_opt(&k.name).await?;
                let v = found.and_then(|s| s.data).and_then(|d| {
                    d.get(&k.key)
                        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                });
                if v.is_none() && k.optional != Some(true) {
                    anyhow::bail!(
                        "secret {namespace}/{} key {} (env {}) not found",
                        k.name,
                        k.key,
                        e.name
                    );
                }
                v
            } else if let Some(k) = &from.config_map_key_ref {
                let found = config_maps.get_opt(&k.name).await?;
                let v = found
                    .and_then(|cm| cm.data)
                    .and_then(|d| d.get(&k.key).cloned());
                if v.is_none() && k.optional != Some(true) {
                    anyhow::bail!(
                        "configmap {namespace}/{} key {} (env {}) not found",
                        k.name,
                        k.key,
                        e.name
                    );
                }
                v
            } else {
                None
            }
        } else {
            Some(String::new())
        };
        if let Some(v) = value {
            set(&mut env, e.name.clone(), v);
        }
    }
    Ok(env)
}

fn field_value(pod: &Pod, path: &str, ip: Ipv4Addr) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let bracketed = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix("']"))
            .map(str::to_string)
    };
    if let Some(k) = bracketed("metadata.labels['") {
        return meta.labels.as_ref().and_then(|l| l.get(&k).cloned());
    }
    if let Some(k) = bracketed("metadata.annotations['") {
        return meta.annotations.as_ref().and_then(|a| a.get(&k).cloned());
    }
    match path {
        "metadata.name" => meta.name.clone(),
        "metadata.namespace" => meta.namespace.clone(),
        "metadata.uid" => meta.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" => Some(ip.to_string()),
        "status.podIPs" => Some(ip.to_string()),
        "status.hostIP" => pod.status.as_ref().and_then(|s| s.host_ip.clone()),
        _ => None,
    }
}

/// `pid` and every process below it.
fn descendants(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parents.push((child, ppid));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(
            "*stoker-loader*",
            "ghcr.io/stoker-dev/stoker-loader:0.1"
        ));
        assert!(!glob_match(
            "*stoker-loader*",
            "ghcr.io/stoker-dev/trainer:0.1"
        ));
        assert!(glob_match("sim/trainer:*", "sim/trainer:1"));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("a*b*c", "acb"));
    }

    #[test]
    fn rewrites_listen_addresses_and_mount_paths() {
        let ip = Ipv4Addr::new(10, 213, 1, 7);
        let mounts = vec![("/etc/stoker".to_string(), "/tmp/v/config".to_string())];
        assert_eq!(
            rewrite_value("0.0.0.0:9090", ip, &mounts),
            "10.213.1.7:9090"
        );
        assert_eq!(
            rewrite_value("/etc/stoker/config.yaml", ip, &mounts),
            "/tmp/v/config/config.yaml"
        );
        assert_eq!(
            rewrite_value("--config=/etc/stoker/a", ip, &mounts),
            "--config=/tmp/v/config/a"
        );
        assert_eq!(rewrite_value("/etc/stokerx", ip, &mounts), "/etc/stokerx");
    }

    #[test]
    fn expands_references() {
        let vars = BTreeMap::from([("A".to_string(), "1".to_string())]);
        assert_eq!(expand_vars("x$(A)y$(B)$$(A)", &vars), "x1y$(B)$(A)");
    }
}
