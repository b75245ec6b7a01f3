//! What a kubelet would do for the simulated nodes.
//!
//! A pod bound to one of the runtime's nodes, once KWOK has given it an IP from the node's pod
//! CIDR, gets that IP on the node namespace's `eth0` and one container per container it knows
//! how to run ([`Launch`]). By default every container runs in runc from its image, as strictly
//! as a kubelet runs it ([`oci`]: users, `runAsNonRoot` refusals, read-only roots, capabilities,
//! seccomp, CPU and memory limits as cgroup limits, sized memory-backed emptyDirs, the projected
//! service-account token): stoker's loader from stoker's image, other images from the source
//! the caller mapped them to. Host-process mode ([`ImageSource::HostProcess`]: a root process of
//! this machine, limits ignored, `KUBECONFIG` for the API) is kept for the tests that say why.
//!
//! Pods on one node share the node's network namespace, so the runtime makes each container
//! bind its pod's IP: it sets `POD_IP`, rewrites `0.0.0.0:PORT` in args and env values to
//! `$POD_IP:PORT`, and gives the loader `STOKER_GRPC_ADDR` and `STOKER_HTTP_ADDR` on the pod IP.
//! Volumes (configMap, secret, emptyDir, the projected token) are directories under the
//! runtime's directory, mounted at their paths; secret and configMap volumes are rewritten from
//! the API every 10 s, as the kubelet syncs them. Env comes from `env` (values, `$(VAR)`
//! references, fieldRef, secretKeyRef, configMapKeyRef) and `envFrom`.
//!
//! Pod status follows the containers: restart counts, the last exit code (137 and `OOMKilled`
//! after a kernel OOM kill), Ready from the container being up and its HTTP readiness probe (if
//! any) passing, and Succeeded/Failed once every container of a pod that does not restart has
//! ended. Native sidecars (init containers with `restartPolicy: Always`) start before the
//! containers (which wait until every sidecar has started, not for its startup probe) and, as
//! the kubelet does, are sent SIGTERM once every regular container has ended; the phase then
//! follows the regular containers' exit codes. Not run: ordinary init containers, exec/TCP
//! probes, startup and liveness probes. A stopped pod's address stays on `eth0` until the runtime stops (KWOK may give it to
//! the next pod of the node, which then reuses it).

use super::image::{Image, ImageSource, ImageStore};
use super::net::NetNode;
use super::oci::{self, ConfigError};
use super::runc::{self, Exit, RuncContainer};
use super::volume;
use anyhow::{Context, Result, anyhow};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::Api;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::process::Component;

/// How the runtime runs the containers of an image.
#[derive(Clone, Debug)]
pub struct ImageMapping {
    /// Image pattern; `*` matches any run of characters.
    pub image: String,
    pub source: ImageSource,
}

impl ImageMapping {
    /// Host-process mode: `command`, then the container's `args`, as a root process of this
    /// machine (not a container; see [`ImageSource::HostProcess`]).
    pub fn new(
        image: impl Into<String>,
        command: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            image: image.into(),
            source: ImageSource::HostProcess(command.into_iter().map(Into::into).collect()),
        }
    }

    /// Host-process mode: images matching `image` run their container's `command` + `args` as
    /// they are.
    pub fn host_command(image: impl Into<String>) -> Self {
        Self {
            image: image.into(),
            source: ImageSource::HostProcess(Vec::new()),
        }
    }

    /// Containers of `image` run in runc from `source`.
    pub fn container(image: impl Into<String>, source: ImageSource) -> Self {
        Self {
            image: image.into(),
            source,
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

/// What the supervisor needs to know to turn containers into processes or runc containers.
pub struct Launch {
    /// How containers of `loader_image` run.
    pub loader: ImageSource,
    pub loader_image: String,
    pub images: Vec<ImageMapping>,
    pub store: Arc<ImageStore>,
    /// KUBECONFIG for host processes (the API server is proxied into every node namespace on
    /// the same loopback address and port).
    pub kubeconfig: PathBuf,
    /// The API server's port on the node namespaces' loopback (containers' in-cluster config).
    pub api_port: u16,
    pub logs: PathBuf,
    pub volumes: PathBuf,
    pub memory_volumes: PathBuf,
    /// runc's state directory and the containers' bundles.
    pub runc_root: PathBuf,
    pub bundles: PathBuf,
    /// Parent of every container's cgroup (`<parent>/<pod uid>/<container>`).
    pub cgroup_parent: String,
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

/// How a container runs.
enum Exec {
    /// A root process of this machine in the node's network namespace.
    Host {
        program: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    /// A runc container (the network namespace is filled in at start).
    Runc(Box<oci::ContainerPlan>),
    /// The kubelet would refuse to create it: this message, as `CreateContainerConfigError`.
    Refused(String),
}

enum Proc {
    Host(Component),
    Runc(RuncContainer),
}

impl Proc {
    fn exited(&mut self) -> Option<Exit> {
        match self {
            Proc::Host(p) => p.exited().map(|status| Exit {
                code: status
                    .code()
                    .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
                oom_killed: false,
            }),
            Proc::Runc(c) => c.exited(),
        }
    }

    fn pid(&self) -> u32 {
        match self {
            Proc::Host(p) => p.pid(),
            Proc::Runc(c) => c.pid(),
        }
    }

    fn terminate(&self) {
        match self {
            // SAFETY: kill(2) on a process this runtime started.
            Proc::Host(p) => unsafe {
                libc::kill(p.pid() as libc::pid_t, libc::SIGTERM);
            },
            Proc::Runc(c) => c.signal(libc::SIGTERM),
        }
    }
}

struct ContainerRun {
    name: String,
    exec: Exec,
    loader: bool,
    /// A native sidecar: starts before the regular containers, restarts whatever the pod's
    /// policy, ends with the regular containers.
    sidecar: bool,
    /// SIGTERM sent because the regular containers ended: its exit is final.
    stopping: bool,
    metrics_port: u16,
    readiness: Option<Readiness>,
    process: Option<Proc>,
    restarts: u32,
    started: Instant,
    ever_started: bool,
    next_start: Instant,
    backoff: Duration,
    finished: bool,
    last_exit: Option<Exit>,
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
    last_exit: Option<Exit>,
    refused: Option<String>,
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
    /// Sized tmpfs mounts of memory-backed emptyDirs, unmounted when the pod stops.
    tmpfs: Vec<PathBuf>,
    cgroup: String,
    containers: Vec<ContainerRun>,
    reported: Option<Vec<ContainerReport>>,
    /// Secret and configMap volumes, rewritten from the API every [`VOLUME_SYNC`] as the
    /// kubelet does, so that a container restarted after a change sees it (a service-account
    /// token Secret mounted before the token controller filled it, say).
    synced: Vec<SyncedVolume>,
    fs_group: Option<u32>,
    next_sync: Instant,
}

/// A secret or configMap volume and its directory.
struct SyncedVolume {
    volume: k8s_openapi::api::core::v1::Volume,
    dir: PathBuf,
}

/// How often secret and configMap volumes are rewritten (the kubelet's sync period is a
/// minute plus its cache's TTL; shorter here, where tests wait on it).
const VOLUME_SYNC: Duration = Duration::from_secs(10);

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

/// A pod volume on this machine.
struct VolumeDir {
    dir: PathBuf,
    /// configMap, secret and projected volumes are read-only in every container.
    readonly: bool,
}

impl PodRun {
    pub fn key(&self) -> (String, String) {
        (self.namespace.clone(), self.name.clone())
    }

    /// Builds every runnable container of `pod` (volumes written, env resolved, images
    /// unpacked) without starting anything. Containers whose image maps to nothing are skipped
    /// with a log line.
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
            let source = if loader {
                launch.loader.clone()
            } else if let Some(m) = launch.images.iter().find(|m| glob_match(&m.image, &image)) {
                m.source.clone()
            } else {
                tracing::debug!(pod = %name, container = %c.name, %image, "no local command for this image; not run");
                continue;
            };
            runnable.push((c, sidecar, loader, source));
        }
        let strict = runnable
            .iter()
            .any(|(_, _, _, s)| !matches!(s, ImageSource::HostProcess(_)));
        let fs_group = spec
            .security_context
            .as_ref()
            .and_then(|s| s.fs_group)
            .map(|g| g as u32);
        // Only what the runnable containers mount (pods of other images cost nothing).
        let mounted: std::collections::BTreeSet<&str> = runnable
            .iter()
            .flat_map(|(c, _, _, _)| c.volume_mounts.iter().flatten())
            .map(|m| m.name.as_str())
            .collect();
        let pod_dir = format!("{namespace}_{name}_{}", &uid[..uid.len().min(8)]);
        let mut dirs = Vec::new();
        let mut tmpfs = Vec::new();
        let mut synced_volumes = Vec::new();
        let mut volumes: BTreeMap<String, VolumeDir> = BTreeMap::new();
        for volume in spec
            .volumes
            .iter()
            .flatten()
            .filter(|v| mounted.contains(v.name.as_str()))
        {
            let memory =
                volume.empty_dir.as_ref().and_then(|e| e.medium.as_deref()) == Some("Memory");
            let base = if memory && !strict {
                &launch.memory_volumes
            } else {
                &launch.volumes
            };
            let dir = base.join(&pod_dir).join(&volume.name);
            std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
            if !dirs.contains(&base.join(&pod_dir)) {
                dirs.push(base.join(&pod_dir));
            }
            let mut readonly = true;
            if volume.config_map.is_some() || volume.secret.is_some() {
                let synced = SyncedVolume {
                    volume: volume.clone(),
                    dir: dir.clone(),
                };
                synced.write(client, &namespace).await?;
                synced_volumes.push(synced);
            } else if let Some(projected) = &volume.projected {
                if strict {
                    volume::write_projected(client, pod, projected, &dir).await?;
                } else {
                    // Host processes use KUBECONFIG instead.
                    tracing::debug!(pod = %name, volume = %volume.name, "projected volume left empty");
                }
            } else if let Some(empty) = &volume.empty_dir {
                readonly = false;
                if memory && strict {
                    let size = volume::tmpfs_size(empty.size_limit.as_ref(), spec)?;
                    volume::mount_tmpfs(&dir, size)?;
                    tmpfs.push(dir.clone());
                }
                // The kubelet makes emptyDirs world-writable.
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
            } else {
                readonly = false;
                tracing::warn!(pod = %name, volume = %volume.name, "volume kind not supported by the node runtime; an empty directory stands in");
            }
            if strict && let Some(group) = fs_group {
                volume::set_group_ownership(&dir, group, readonly)?;
            }
            volumes.insert(volume.name.clone(), VolumeDir { dir, readonly });
        }

        let cgroup = format!("{}/{uid}", launch.cgroup_parent);
        let mut containers = Vec::new();
        for (c, sidecar, loader, source) in runnable {
            let metrics_port = metrics_port(c);
            let input = ContainerInput {
                launch,
                pod,
                c,
                env: resolve_env(client, pod, c, ip).await?,
                volumes: &volumes,
                ip,
                loader,
                metrics_port,
            };
            let exec = match &source {
                ImageSource::HostProcess(command) => input.host(command),
                _ => {
                    let store = launch.store.clone();
                    let image = tokio::task::block_in_place(|| store.get(&source))?
                        .ok_or_else(|| anyhow!("image of container {} has no root", c.name))?;
                    match input.runc(&image, format!("{cgroup}/{}", c.name)) {
                        Ok(plan) => Exec::Runc(Box::new(plan)),
                        Err(refused) => {
                            tracing::warn!(pod = %name, container = %c.name, %refused, "container refused");
                            Exec::Refused(refused.0)
                        }
                    }
                }
            };
            let now = Instant::now();
            containers.push(ContainerRun {
                name: c.name.clone(),
                exec,
                loader,
                sidecar,
                stopping: false,
                metrics_port,
                readiness: Readiness::of(c),
                process: None,
                restarts: 0,
                started: now,
                ever_started: false,
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
            tmpfs,
            cgroup,
            containers,
            reported: None,
            synced: synced_volumes,
            fs_group: fs_group.filter(|_| strict),
            next_sync: Instant::now() + VOLUME_SYNC,
        })
    }

    /// Rewrites the pod's secret and configMap volumes from the API when they are due; a
    /// failed read leaves the files as they were.
    pub async fn sync_volumes(&mut self, client: &kube::Client) {
        if Instant::now() < self.next_sync {
            return;
        }
        self.next_sync = Instant::now() + VOLUME_SYNC;
        for synced in &self.synced {
            let written = async {
                synced.write(client, &self.namespace).await?;
                if let Some(group) = self.fs_group {
                    volume::set_group_ownership(&synced.dir, group, true)?;
                }
                anyhow::Ok(())
            };
            if let Err(err) = written.await {
                tracing::debug!(pod = %self.name, volume = %synced.volume.name, err = format!("{err:#}"), "volume not synced");
            }
        }
    }

    /// No container of the pod runs here (no local command for its images).
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// Starts containers that are due: not yet started, or exited and due for a restart under
    /// the pod's restart policy. Native sidecars start first: regular containers wait until
    /// every sidecar has started once.
    pub fn supervise(&mut self, netns: &NetNode, launch: &Launch) {
        let now = Instant::now();
        let regular_ended = self.containers.iter().any(|c| !c.sidecar)
            && self.containers.iter().all(|c| c.sidecar || c.finished);
        let sidecars_started = self
            .containers
            .iter()
            .all(|c| !c.sidecar || c.ever_started || matches!(c.exec, Exec::Refused(_)));
        for c in &mut self.containers {
            if c.finished {
                continue;
            }
            if regular_ended && !c.stopping {
                c.stopping = true;
                match &c.process {
                    Some(p) => p.terminate(),
                    None => c.finished = true,
                }
                continue;
            }
            if let Some(p) = &mut c.process {
                let Some(exit) = p.exited() else {
                    if let Some(r) = &mut c.readiness {
                        r.probe(self.ip, now);
                    }
                    continue;
                };
                c.process = None;
                if let Some(r) = &mut c.readiness {
                    r.reset();
                }
                c.last_exit = Some(exit);
                let restart = match self.restart_policy.as_str() {
                    _ if c.stopping => false,
                    _ if c.sidecar => true,
                    "Never" => false,
                    "OnFailure" => exit.code != 0,
                    _ => true,
                };
                tracing::info!(pod = %self.name, container = %c.name, code = exit.code, oom_killed = exit.oom_killed, restart, "container exited");
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
            if now < c.next_start || (!c.sidecar && !sidecars_started) {
                continue;
            }
            let log_name = if c.restarts == 0 {
                format!("{}_{}_{}", self.namespace, self.name, c.name)
            } else {
                format!("{}_{}_{}.{}", self.namespace, self.name, c.name, c.restarts)
            };
            let started = match &mut c.exec {
                Exec::Refused(_) => continue,
                Exec::Host { program, args, env } => {
                    let mut argv = vec![
                        "netns".to_string(),
                        "exec".into(),
                        netns.netns.clone(),
                        "env".into(),
                    ];
                    argv.extend(
                        env.iter()
                            .filter(|(k, _)| !k.is_empty() && !k.contains('='))
                            .map(|(k, v)| format!("{k}={v}")),
                    );
                    argv.push(program.clone());
                    argv.extend(args.iter().cloned());
                    Component::start(&log_name, Path::new("ip"), &argv, &launch.logs)
                        .map(Proc::Host)
                        .map_err(anyhow::Error::from)
                }
                Exec::Runc(plan) => {
                    plan.netns = PathBuf::from("/var/run/netns").join(&netns.netns);
                    start_runc(
                        launch,
                        &self.uid,
                        &c.name,
                        plan,
                        &launch.logs.join(format!("{log_name}.log")),
                    )
                    .map(Proc::Runc)
                }
            };
            match started {
                Ok(p) => {
                    tracing::info!(pod = %self.name, container = %c.name, pid = p.pid(), node = %self.node, ip = %self.ip, "container started");
                    c.process = Some(p);
                    c.started = now;
                    c.ever_started = true;
                }
                Err(err) => {
                    tracing::warn!(pod = %self.name, container = %c.name, err = format!("{err:#}"), "container failed to start");
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
                refused: match &c.exec {
                    Exec::Refused(message) => Some(message.clone()),
                    _ => None,
                },
            })
            .collect()
    }

    /// A strategic-merge patch of the pod's status when its processes changed since the last
    /// one: restart counts, container states (OOMKilled, CreateContainerConfigError as the
    /// kubelet reports them), Ready, and the phase once every process of a pod that does not
    /// restart has ended. KWOK marked the pod Running and Ready when it was bound; the first
    /// report, all running, matches that and patches nothing.
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
        let terminated = |exit: &Exit| {
            let reason = match exit.code {
                _ if exit.oom_killed => "OOMKilled",
                0 => "Completed",
                _ => "Error",
            };
            serde_json::json!({"terminated": {"exitCode": exit.code, "reason": reason, "finishedAt": now}})
        };
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
                entry["state"] = if let Some(message) = &r.refused {
                    serde_json::json!({"waiting": {"reason": "CreateContainerConfigError", "message": message}})
                } else if r.running {
                    serde_json::json!({"running": {"startedAt": now}})
                } else if r.finished {
                    terminated(&r.last_exit.unwrap_or(Exit {
                        code: 0,
                        oom_killed: false,
                    }))
                } else if r.last_exit.is_some() {
                    serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}})
                } else {
                    serde_json::json!({"waiting": {"reason": "ContainerCreating"}})
                };
                if let Some(exit) = &r.last_exit {
                    entry["lastState"] = terminated(exit);
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
                .all(|r| r.last_exit.map(|e| e.code) == Some(0));
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
    /// period; then removes the pod's containers, volumes and cgroups. Blocking.
    pub fn stop(mut self, launch: &Launch) {
        let mut all = Vec::new();
        for c in &self.containers {
            match &c.process {
                Some(Proc::Host(p)) => {
                    let tree = descendants(p.pid());
                    for pid in &tree {
                        // SAFETY: kill(2) on processes this runtime started (and their
                        // children).
                        unsafe { libc::kill(*pid as libc::pid_t, libc::SIGTERM) };
                    }
                    all.extend(tree);
                }
                Some(Proc::Runc(r)) => r.signal(libc::SIGTERM),
                None => {}
            }
        }
        let deadline = Instant::now() + self.grace;
        for c in &mut self.containers {
            match c.process.take() {
                Some(Proc::Host(mut p)) => {
                    p.stop(deadline.saturating_duration_since(Instant::now()))
                }
                Some(Proc::Runc(mut r)) => {
                    r.stop(deadline.saturating_duration_since(Instant::now()));
                }
                None => {}
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
        for c in &self.containers {
            if matches!(c.exec, Exec::Runc(_)) {
                let bundle = launch.bundles.join(format!("{}-{}", self.uid, c.name));
                volume::unmount(&bundle.join("rootfs"));
                let _ = std::fs::remove_dir_all(&bundle);
            }
        }
        for dir in &self.tmpfs {
            volume::unmount(dir);
        }
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
        runc::remove_cgroup(&self.cgroup);
        tracing::info!(pod = %self.name, node = %self.node, "pod stopped");
    }
}

/// Starts one runc container: its root an overlay of the image's (so the image stays
/// unchanged), then `runc run`.
fn start_runc(
    launch: &Launch,
    pod_uid: &str,
    name: &str,
    plan: &oci::ContainerPlan,
    log: &Path,
) -> Result<RuncContainer> {
    let id = format!("{pod_uid}-{name}");
    let bundle = launch.bundles.join(&id);
    let rootfs = bundle.join("rootfs");
    volume::unmount(&rootfs);
    let _ = std::fs::remove_dir_all(bundle.join("upper"));
    let _ = std::fs::remove_dir_all(bundle.join("work"));
    volume::mount_overlay(
        &plan.rootfs,
        &bundle.join("upper"),
        &bundle.join("work"),
        &rootfs,
    )?;
    let mut plan = plan.clone();
    plan.rootfs = rootfs;
    RuncContainer::start(&launch.runc_root, &id, &bundle, &oci::spec(&plan), log)
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

/// One container of a pod being prepared.
struct ContainerInput<'a> {
    launch: &'a Launch,
    pod: &'a Pod,
    c: &'a Container,
    /// The container's own `env` and `envFrom`, resolved.
    env: Vec<(String, String)>,
    volumes: &'a BTreeMap<String, VolumeDir>,
    ip: Ipv4Addr,
    loader: bool,
    metrics_port: u16,
}

/// The default PATH of container runtimes.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl ContainerInput<'_> {
    fn pod_name(&self) -> String {
        self.pod.metadata.name.clone().unwrap_or_default()
    }

    /// What the runtime adds to every container's environment: `POD_IP`, `HOSTNAME`, and for
    /// the loader its listen addresses on the pod IP (pods of a node share its network
    /// namespace, so a wildcard listener would take the port from every other pod there).
    fn extra_env(&self) -> Vec<(String, String)> {
        let mut extra = vec![
            ("POD_IP".to_string(), self.ip.to_string()),
            ("HOSTNAME".to_string(), self.pod_name()),
        ];
        if self.loader {
            extra.push((
                "STOKER_HTTP_ADDR".into(),
                format!("{}:{}", self.ip, self.metrics_port),
            ));
            extra.push(("STOKER_GRPC_ADDR".into(), format!("{}:50051", self.ip)));
        }
        extra
    }

    /// A root process of this machine: the mapped `command` (or the container's), its args,
    /// listen addresses and mount paths rewritten (see the module doc).
    fn host(self, command: &[String]) -> Exec {
        let c = self.c;
        // What the runtime puts first (`host_words` of it) is a path on this machine, never
        // rewritten into a mount: a checkout under /tmp would land in the pod's /tmp volume.
        let (mut command, host_words) = if command.is_empty() {
            (c.command.clone().unwrap_or_default(), 0)
        } else {
            (command.to_vec(), command.len())
        };
        command.extend(c.args.clone().unwrap_or_default());
        if command.is_empty() {
            return Exec::Refused(format!("no command specified (container {})", c.name));
        }
        let mounts = mounts_of(c, self.volumes);
        let mut env = self.env.clone();
        let mut extra = self.extra_env();
        extra.push((
            "KUBECONFIG".to_string(),
            self.launch.kubeconfig.display().to_string(),
        ));
        for (k, v) in extra {
            if !env.iter().any(|(name, _)| *name == k) {
                env.push((k, v));
            }
        }
        let vars: BTreeMap<String, String> = env.iter().cloned().collect();
        let ip = self.ip;
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
        Exec::Host {
            program,
            args: command.collect(),
            env,
        }
    }

    /// A runc container from `image`: the kubelet's command/args/env rules, security
    /// context, limits and volume mounts. Refused as the kubelet would refuse it.
    fn runc(self, image: &Image, cgroup: String) -> Result<oci::ContainerPlan, ConfigError> {
        let (c, pod) = (self.c, self.pod);
        let pod_ref = format!(
            "{}_{}({})",
            self.pod_name(),
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.uid.as_deref().unwrap_or_default()
        );
        let passwd = std::fs::read_to_string(image.rootfs.join("etc/passwd")).unwrap_or_default();
        let user = oci::image_user(image.config.user.as_deref(), &passwd);
        let pod_sc = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
        let security = oci::security(&pod_ref, pod_sc, c, user)?;

        let mut env: Vec<(String, String)> = image
            .config
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
            env.retain(|(name, _)| *name != k);
            env.push((k, v));
        };
        for (k, v) in self.env.iter().cloned() {
            set(&mut env, k, v);
        }
        // In-cluster config: the API server as the node namespaces see it (the proxy on
        // loopback; a Service's cluster IP is not routed here), with the projected token.
        let mut extra = self.extra_env();
        extra.push(("KUBERNETES_SERVICE_HOST".into(), "127.0.0.1".into()));
        extra.push((
            "KUBERNETES_SERVICE_PORT".into(),
            self.launch.api_port.to_string(),
        ));
        extra.push(("PATH".into(), DEFAULT_PATH.into()));
        for (k, v) in extra {
            if !env.iter().any(|(name, _)| *name == k) {
                env.push((k, v));
            }
        }
        let vars: BTreeMap<String, String> = env.iter().cloned().collect();
        let ip = self.ip;
        let rewrite = |s: &str| rewrite_value(&expand_vars(s, &vars), ip, &[]);
        let env: Vec<String> = env
            .iter()
            .map(|(k, v)| format!("{k}={}", rewrite_value(v, ip, &[])))
            .collect();
        // The kubelet's rules: `command` replaces the image's Entrypoint and Cmd; `args` alone
        // replaces Cmd.
        let args: Vec<String> = match (&c.command, &c.args) {
            (Some(cmd), args) if !cmd.is_empty() => cmd
                .iter()
                .chain(args.iter().flatten())
                .map(|a| rewrite(a))
                .collect(),
            (_, Some(args)) => image
                .config
                .entrypoint
                .iter()
                .cloned()
                .chain(args.iter().map(|a| rewrite(a)))
                .collect(),
            (_, None) => image
                .config
                .entrypoint
                .iter()
                .chain(image.config.cmd.iter())
                .cloned()
                .collect(),
        };
        if args.is_empty() {
            return Err(ConfigError(format!(
                "no command specified (pod: {pod_ref:?}, container: {})",
                c.name
            )));
        }

        let mut mounts = Vec::new();
        let binds = (image.host_binds.iter().map(|b| (b, true)))
            .chain(image.host_writable.iter().map(|b| (b, false)));
        for (bind, readonly) in binds {
            mounts.push(oci::Mount {
                destination: bind.display().to_string(),
                source: bind.clone(),
                readonly,
            });
        }
        for m in c.volume_mounts.iter().flatten() {
            let Some(volume) = self.volumes.get(&m.name) else {
                continue;
            };
            let source = match m.sub_path.as_deref() {
                Some(sub) if !sub.is_empty() => volume.dir.join(sub),
                _ => volume.dir.clone(),
            };
            mounts.push(oci::Mount {
                destination: m.mount_path.clone(),
                source,
                readonly: volume.readonly || m.read_only == Some(true),
            });
        }
        let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
        let hostname: String = self.pod_name().chars().take(63).collect();
        Ok(oci::ContainerPlan {
            rootfs: image.rootfs.clone(),
            args,
            env,
            cwd: c
                .working_dir
                .clone()
                .or(image.config.working_dir.clone())
                .unwrap_or_else(|| "/".into()),
            hostname,
            security,
            cpu_millis: limits.and_then(|l| l.get("cpu")).and_then(volume::millis),
            memory_bytes: limits.and_then(|l| l.get("memory")).and_then(volume::bytes),
            mounts,
            netns: PathBuf::new(),
            cgroups_path: cgroup,
        })
    }
}

pub(super) async fn config_map_files(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    optional: Option<bool>,
) -> Result<BTreeMap<String, Vec<u8>>> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    match api.get_opt(name).await? {
        Some(found) => {
            for (k, v) in found.data.unwrap_or_default() {
                files.insert(k, v.into_bytes());
            }
            for (k, v) in found.binary_data.unwrap_or_default() {
                files.insert(k, v.0);
            }
        }
        None if optional == Some(true) => {}
        None => anyhow::bail!("configmap {namespace}/{name} not found"),
    }
    Ok(files)
}

pub(super) async fn secret_files(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    optional: Option<bool>,
) -> Result<BTreeMap<String, Vec<u8>>> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    match api.get_opt(name).await? {
        Some(found) => {
            for (k, v) in found.data.unwrap_or_default() {
                files.insert(k, v.0);
            }
            for (k, v) in found.string_data.unwrap_or_default() {
                files.insert(k, v.into_bytes());
            }
        }
        None if optional == Some(true) => {}
        None => anyhow::bail!("secret {namespace}/{name} not found"),
    }
    Ok(files)
}

/// A downward-API field of `pod`, its IP from its status.
pub(super) fn field_value_of(pod: &Pod, path: &str) -> Option<String> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .unwrap_or(Ipv4Addr::UNSPECIFIED);
    field_value(pod, path, ip)
}

impl SyncedVolume {
    /// Writes the Secret's or ConfigMap's current files into the directory.
    async fn write(&self, client: &kube::Client, namespace: &str) -> Result<()> {
        if let Some(cm) = &self.volume.config_map {
            let files = config_map_files(client, namespace, &cm.name, cm.optional).await?;
            write_volume(&self.dir, files, cm.items.as_deref(), cm.default_mode)
        } else if let Some(secret) = &self.volume.secret {
            let name = secret.secret_name.clone().unwrap_or_default();
            let files = secret_files(client, namespace, &name, secret.optional).await?;
            write_volume(
                &self.dir,
                files,
                secret.items.as_deref(),
                secret.default_mode,
            )
        } else {
            Ok(())
        }
    }
}

fn write_volume(
    dir: &Path,
    files: BTreeMap<String, Vec<u8>>,
    items: Option<&[k8s_openapi::api::core::v1::KeyToPath]>,
    default_mode: Option<i32>,
) -> Result<()> {
    for (key, body) in files {
        let (rel, mode) = match items {
            Some(items) => match items.iter().find(|i| i.key == key) {
                Some(item) => (item.path.clone(), item.mode),
                None => continue,
            },
            None => (key, None),
        };
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, body).with_context(|| path.display().to_string())?;
        let mode = mode.or(default_mode).unwrap_or(0o644) as u32;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// (mount path, host directory), longest mount path first.
fn mounts_of(c: &Container, volumes: &BTreeMap<String, VolumeDir>) -> Vec<(String, String)> {
    let mut mounts: Vec<(String, String)> = c
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let dir = &volumes.get(&m.name)?.dir;
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
