//! The loader sidecar the webhook injects into a trainer pod, and the pieces of the trainer
//! pod it needs: the memory-backed ring volume, the trainer containers' wiring, the group that
//! lets a non-root trainer reach the sidecar, and what the pod says about its trainer processes
//! (how many: [`local_ranks`]; where in the job: the sidecar's rank environment).
//!
//! The loader runs as a native sidecar (an init container with `restartPolicy: Always`) whose
//! startup probe passes once its unix sockets listen, one per local rank, so the trainer
//! containers start only when they can connect.

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, Pod, PodSecurityContext, Probe, ResourceRequirements, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube_quantity::ParsedQuantity;
use stoker_contract::{
    ANNOTATION_LOCAL_RANKS, RenderError, SHM_DIR, SIDECAR_HEALTH_PORT, env as contract_env,
};

use super::decoder_pod::{credentials_env_from, instance_metadata_env};
use super::{BuildDefaults, restricted_security_context};
use crate::api::{ANNOTATION_RANK, ANNOTATION_WORLD_SIZE, DataPipeline};

pub const SIDECAR_NAME: &str = "stoker-loader";
pub const SHM_VOLUME: &str = "stoker-shm";
/// The sidecar's user and group: the loader image's nonroot user.
pub const SIDECAR_ID: i64 = 65532;

/// The completion index of an Indexed Job's pod (JobSet, torchrun on Jobs): its place in the job.
pub const JOB_COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";
/// Where a trainer pod's rank comes from when its containers do not set `RANK`: our own
/// annotation, else the completion index of an Indexed Job.
pub const RANK_SOURCES: [&str; 2] = [ANNOTATION_RANK, JOB_COMPLETION_INDEX];

/// A trainer container's literal env that counts its processes, first found wins: torchrun's
/// own, Kubeflow PyTorchJob's, and the usual spelling in launch scripts.
const LOCAL_RANKS_ENV: [&str; 3] = ["LOCAL_WORLD_SIZE", "PET_NPROC_PER_NODE", "NPROC_PER_NODE"];
/// A trainer container's env that gives its pod's node rank, first found wins: Kubeflow
/// PyTorchJob's, the usual spelling in launch scripts, torchrun's.
const NODE_RANK_ENV: [&str; 3] = ["PET_NODE_RANK", "NODE_RANK", "GROUP_RANK"];
/// The trainer's GPUs: one trainer process each when nothing else says how many.
const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The most trainer processes one sidecar serves (one ring each); more is taken for a typo.
pub const MAX_LOCAL_RANKS: u32 = 1024;

/// A count of trainer processes in the pod that is neither a number nor `gpu`/`auto`.
#[derive(Debug, thiserror::Error)]
#[error(
    "{origin} is {value:?}, not a number of trainer processes per pod (1 to {MAX_LOCAL_RANKS}, gpu or auto); fix it, or say the number in the pod annotation {ANNOTATION_LOCAL_RANKS}"
)]
pub struct LocalRanksError {
    /// Where the value was read, e.g. `env PET_NPROC_PER_NODE of container "trainer"`.
    pub origin: String,
    pub value: String,
}

impl LocalRanksError {
    pub fn category(&self) -> &'static str {
        "local_ranks"
    }
}

/// What one source says about the pod's trainer processes.
#[derive(Debug, PartialEq)]
enum Declared {
    Count(u32),
    /// `gpu` or `auto`: one per GPU.
    PerGpu,
}

/// Reads one source's value. A reference to a variable (`$(NPROC)`, `$NPROC`) is unknown at
/// admission, so the next source answers.
fn declared(origin: String, value: &str) -> Result<Option<Declared>, LocalRanksError> {
    let v = value.trim().trim_matches(['"', '\'']);
    if v.starts_with('$') {
        return Ok(None);
    }
    match v {
        "gpu" | "auto" => Ok(Some(Declared::PerGpu)),
        _ => match v.parse::<u32>() {
            Ok(n) if (1..=MAX_LOCAL_RANKS).contains(&n) => Ok(Some(Declared::Count(n))),
            _ => Err(LocalRanksError {
                origin,
                value: value.to_string(),
            }),
        },
    }
}

/// The value of `--nproc-per-node` (or `--nproc_per_node`) given to torchrun or `python -m
/// torch.distributed.run` in the container's command and args, shell strings included.
fn nproc_per_node(c: &Container) -> Option<&str> {
    let mut words = c
        .command
        .iter()
        .chain(c.args.iter())
        .flatten()
        .flat_map(|s| s.split_whitespace());
    words.find(|w| {
        w.rsplit('/').next() == Some("torchrun")
            || matches!(*w, "torch.distributed.run" | "torch.distributed.launch")
    })?;
    while let Some(w) = words.next() {
        for flag in ["--nproc-per-node", "--nproc_per_node"] {
            if let Some(rest) = w.strip_prefix(flag) {
                if rest.is_empty() {
                    return words.next();
                }
                if let Some(value) = rest.strip_prefix('=') {
                    return Some(value);
                }
            }
        }
    }
    None
}

fn containers(pod: &Pod) -> impl Iterator<Item = &Container> {
    pod.spec.iter().flat_map(|s| s.containers.iter())
}

/// The largest `nvidia.com/gpu` limit of a trainer container: the container that runs torchrun
/// holds the pod's GPUs.
fn gpu_limit(pod: &Pod) -> u32 {
    containers(pod)
        .filter_map(|c| c.resources.as_ref()?.limits.as_ref()?.get(GPU_RESOURCE))
        .filter_map(|q| q.0.parse::<u32>().ok())
        .max()
        .unwrap_or(0)
}

/// Trainer processes in `pod` (torchrun's `--nproc-per-node`), one ring and socket each. The
/// first source that answers: the annotation `stoker.dev/local-ranks`; a trainer container's
/// literal `LOCAL_WORLD_SIZE`, `PET_NPROC_PER_NODE`, `NPROC_PER_NODE`; `--nproc-per-node` on a
/// torchrun command line. When that says `gpu`/`auto`, or nothing does: the trainer's GPU
/// limit, else 1.
pub fn local_ranks(pod: &Pod) -> Result<u32, LocalRanksError> {
    let annotation = pod.annotations().get(ANNOTATION_LOCAL_RANKS).map(|v| {
        (
            format!("the annotation {ANNOTATION_LOCAL_RANKS}"),
            v.as_str(),
        )
    });
    let env = LOCAL_RANKS_ENV.iter().flat_map(|name| {
        containers(pod).filter_map(move |c| {
            let value = c
                .env
                .iter()
                .flatten()
                .find(|e| e.name == *name)?
                .value
                .as_deref()?;
            Some((format!("env {name} of container {:?}", c.name), value))
        })
    });
    let command = containers(pod).filter_map(|c| {
        let value = nproc_per_node(c)?;
        Some((
            format!("--nproc-per-node in the command of container {:?}", c.name),
            value,
        ))
    });
    for (origin, value) in annotation.into_iter().chain(env).chain(command) {
        match declared(origin, value)? {
            Some(Declared::Count(n)) => return Ok(n),
            Some(Declared::PerGpu) => break,
            None => {}
        }
    }
    Ok(gpu_limit(pod).max(1))
}

/// Bytes of the ring volume: `trainer.sharedMemory` holds one local rank's ring (the CRD's rule
/// checks one), so the pod needs it once per local rank. `None` when it does not parse.
fn shm_bytes(dp: &DataPipeline, local_ranks: u32) -> Option<u64> {
    quantity_bytes(&dp.spec.trainer.shared_memory).map(|b| b.saturating_mul(u64::from(local_ranks)))
}

/// The memory-backed volume the rings live in, `trainer.sharedMemory` per local rank (as the
/// pipeline spells it for one).
pub fn shm_volume(dp: &DataPipeline, local_ranks: u32) -> Volume {
    let shared = &dp.spec.trainer.shared_memory;
    let size = match shm_bytes(dp, local_ranks) {
        Some(bytes) if local_ranks > 1 => bytes.to_string(),
        // The CRD checks it is a quantity; one the parser here misses stays one rank's size,
        // and the sidecar refuses to start with the sizes if its rings do not fit.
        _ => shared.clone(),
    };
    Volume {
        name: SHM_VOLUME.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".to_string()),
            size_limit: Some(Quantity(size)),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    }
}

pub fn shm_mount() -> VolumeMount {
    VolumeMount {
        name: SHM_VOLUME.to_string(),
        mount_path: SHM_DIR.to_string(),
        ..VolumeMount::default()
    }
}

/// Lets a non-root trainer open the sidecar's socket and rings, which the sidecar creates with
/// mode 0660: both must share a group, and nothing is made world-writable for it. Every
/// container of a pod is in the pod's `fsGroup`, and the ring volume is group-owned by it
/// (setgid), so the pod's own `fsGroup` is kept when it has one; else it becomes the sidecar's
/// group, with `OnRootMismatch` so that big volumes are not re-chowned on every start.
pub fn share_ring_group(security: &mut PodSecurityContext) {
    if security.fs_group.is_some() {
        return;
    }
    security.fs_group = Some(SIDECAR_ID);
    security
        .fs_group_change_policy
        .get_or_insert_with(|| "OnRootMismatch".to_string());
}

pub fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        ..EnvVar::default()
    }
}

/// What a trainer container needs to find the sidecar: (name, value) of its environment. The
/// client connects to `$STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock`, torchrun's local rank.
pub fn client_env(pipeline: &str) -> [(&'static str, &str); 2] {
    [
        (contract_env::SHM_DIR, SHM_DIR),
        (contract_env::PIPELINE, pipeline),
    ]
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn from_annotation(name: &str, key: &str) -> EnvVar {
    field_env(name, &format!("metadata.annotations['{key}']"))
}

/// The first trainer container's definition of `name` (literal or downward API).
fn defined<'a>(pod: &'a Pod, name: &str) -> Option<&'a EnvVar> {
    containers(pod)
        .flat_map(|c| c.env.iter().flatten())
        .find(|e| e.name == name)
}

/// Where the sidecar's trainers sit in the job, which decides what it prefetches before each
/// trainer connects and says its own rank. Copied from the trainer containers' definitions
/// (literal or downward API), else read through the downward API from the pod's annotations:
/// - one local rank: `RANK` and `LOCAL_RANK` as the trainer sets them;
/// - several: no `RANK` (torchrun sets one per process; a pod-wide `RANK`, as Kubeflow's, is
///   the node's index) and no `LOCAL_RANK`: the sidecar serves local ranks 0.., from rank
///   `STOKER_NODE_RANK` × local ranks;
/// - `STOKER_NODE_RANK` and `WORLD_SIZE`: [`node_rank_env`], [`world_size_env`].
fn rank_env(pod: &Pod, local_ranks: u32) -> Vec<EnvVar> {
    let mut out = Vec::new();
    if local_ranks <= 1 {
        out.extend(defined(pod, "RANK").cloned().or_else(|| {
            RANK_SOURCES
                .into_iter()
                .find(|k| pod.annotations().contains_key(*k))
                .map(|k| from_annotation("RANK", k))
        }));
        out.extend(defined(pod, "LOCAL_RANK").cloned());
    }
    let node_rank = node_rank_env(pod);
    out.extend(world_size_env(pod, local_ranks, node_rank.is_some()));
    out.extend(node_rank);
    out
}

/// `STOKER_NODE_RANK`: a trainer container's `PET_NODE_RANK`, `NODE_RANK` or `GROUP_RANK`, else
/// an Indexed Job's completion index.
fn node_rank_env(pod: &Pod) -> Option<EnvVar> {
    let name = contract_env::NODE_RANK.to_string();
    NODE_RANK_ENV
        .iter()
        .find_map(|n| defined(pod, n))
        .map(|e| EnvVar { name, ..e.clone() })
        .or_else(|| {
            pod.annotations()
                .contains_key(JOB_COMPLETION_INDEX)
                .then(|| from_annotation(contract_env::NODE_RANK, JOB_COMPLETION_INDEX))
        })
}

/// `WORLD_SIZE`: Kubeflow's node count `PET_NNODES` (a number; a range such as `1:4` is elastic
/// and says none) × local ranks, else a trainer container's `WORLD_SIZE`, else the annotation
/// `stoker.dev/world-size`. `PET_NNODES` first: torchrun starts that many × nproc processes,
/// while Kubeflow's `WORLD_SIZE` counts one per pod when nprocPerNode is `auto` (its default).
/// A pod of several local ranks that says neither its world size nor its node rank is taken
/// for a job of one node: the sidecar refuses ranks past the world size.
fn world_size_env(pod: &Pod, local_ranks: u32, node_rank_known: bool) -> Option<EnvVar> {
    let nodes =
        defined(pod, "PET_NNODES").and_then(|e| e.value.as_deref()?.trim().parse::<u32>().ok());
    if let Some(n) = nodes {
        return Some(env(
            "WORLD_SIZE",
            &n.saturating_mul(local_ranks).to_string(),
        ));
    }
    if let Some(e) = defined(pod, "WORLD_SIZE") {
        return Some(e.clone());
    }
    if pod.annotations().contains_key(ANNOTATION_WORLD_SIZE) {
        return Some(from_annotation("WORLD_SIZE", ANNOTATION_WORLD_SIZE));
    }
    (local_ranks > 1 && !node_rank_known).then(|| env("WORLD_SIZE", &local_ranks.to_string()))
}

/// Bytes of a Kubernetes quantity; `None` when it does not parse (then the ring is not added
/// to the sidecar's memory). Through f64: the crate's integer conversion drops the fraction
/// before scaling ("1.5Mi" would be 1Mi); sizes stay far below 2^53.
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let bytes = ParsedQuantity::try_from(q).ok()?.to_bytes_f64()?;
    (bytes.is_finite() && bytes >= 0.0).then(|| bytes.ceil() as u64)
}

/// The sidecar's resources: the operator's base plus the rings' volume on memory, since tmpfs
/// pages the sidecar writes are charged to its cgroup. Requests equal limits where the base
/// sets both, so a Guaranteed trainer pod stays Guaranteed.
fn sidecar_resources(base: &ResourceRequirements, rings: Option<u64>) -> ResourceRequirements {
    let mut r = base.clone();
    let Some(rings) = rings else {
        return r;
    };
    for list in [r.requests.as_mut(), r.limits.as_mut()]
        .into_iter()
        .flatten()
    {
        if let Some(mem) = list.get_mut("memory")
            && let Some(b) = quantity_bytes(&mem.0)
        {
            *mem = Quantity(b.saturating_add(rings).to_string());
        }
    }
    r
}

/// The loader sidecar container for `pod`, a trainer of `dp` running `local_ranks` trainer
/// processes ([`local_ranks`]).
pub fn sidecar(
    pod: &Pod,
    dp: &DataPipeline,
    defaults: &BuildDefaults,
    local_ranks: u32,
) -> Result<Container, RenderError> {
    let probe = |period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/readyz".to_string()),
            port: IntOrString::Int(i32::from(SIDECAR_HEALTH_PORT)),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let mut security = restricted_security_context();
    security.run_as_user = Some(SIDECAR_ID);
    security.run_as_group = Some(SIDECAR_ID);
    Ok(Container {
        name: SIDECAR_NAME.to_string(),
        image: Some(defaults.loader_image(dp)),
        command: Some(vec![super::LOADER_COMMAND.to_string()]),
        args: Some(super::loader_args::sidecar_args(dp)?),
        restart_policy: Some("Always".to_string()),
        // No STOKER_SOCKET: the sidecar names one socket per local rank in the shm dir.
        env: Some(
            [
                field_env(contract_env::POD_NAME, "metadata.name"),
                field_env(contract_env::NODE_NAME, "spec.nodeName"),
                env(contract_env::SHM_DIR, SHM_DIR),
                env(contract_env::LOCAL_RANKS, &local_ranks.to_string()),
            ]
            .into_iter()
            .chain(rank_env(pod, local_ranks))
            .chain(instance_metadata_env(dp))
            .collect(),
        ),
        env_from: credentials_env_from(dp),
        ports: Some(vec![ContainerPort {
            name: Some("stoker-metrics".to_string()),
            container_port: i32::from(SIDECAR_HEALTH_PORT),
            protocol: Some("TCP".to_string()),
            ..ContainerPort::default()
        }]),
        // The trainer containers start only after this passes: the sockets are listening.
        startup_probe: Some(probe(1, 600)),
        readiness_probe: Some(probe(5, 3)),
        resources: defaults
            .sidecar_resources
            .as_ref()
            .map(|base| sidecar_resources(base, shm_bytes(dp, local_ranks))),
        security_context: Some(security),
        volume_mounts: Some(vec![
            shm_mount(),
            super::decoder_pod::tls_mount(),
            // The sidecar's own identity, not the trainer's (see `sidecar_rbac`).
            super::sidecar_rbac::sidecar_token_mount(),
        ]),
        ..Container::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A pod with one trainer container.
    fn pod(annotations: Value, container: Value) -> Pod {
        let mut container = container;
        container["name"] = json!("trainer");
        serde_json::from_value(json!({
            "metadata": {"name": "t", "annotations": annotations},
            "spec": {"containers": [container]}
        }))
        .expect("pod")
    }

    fn with_env(pairs: &[(&str, &str)]) -> Value {
        let env: Vec<Value> = pairs
            .iter()
            .map(|(k, v)| json!({"name": k, "value": v}))
            .collect();
        json!({"env": env})
    }

    fn gpus(n: u32) -> Value {
        json!({"resources": {"limits": {"nvidia.com/gpu": n.to_string()}}})
    }

    fn ranks(annotations: Value, container: Value) -> u32 {
        local_ranks(&pod(annotations, container)).expect("derives")
    }

    /// `a` with the fields of `b` added.
    fn merged(mut a: Value, b: Value) -> Value {
        for (k, v) in b.as_object().expect("object") {
            a[k] = v.clone();
        }
        a
    }

    #[test]
    fn the_annotation_comes_first() {
        let everything = merged(
            merged(with_env(&[("LOCAL_WORLD_SIZE", "4")]), gpus(8)),
            json!({"command": ["torchrun", "--nproc-per-node", "8", "train.py"]}),
        );
        assert_eq!(ranks(json!({"stoker.dev/local-ranks": "2"}), everything), 2);
    }

    #[test]
    fn then_torchruns_env_then_kubeflows_then_launch_scripts() {
        let both = with_env(&[("PET_NPROC_PER_NODE", "4"), ("LOCAL_WORLD_SIZE", "3")]);
        assert_eq!(ranks(json!({}), both), 3);
        let kubeflow = with_env(&[("PET_NPROC_PER_NODE", "4")]);
        assert_eq!(ranks(json!({}), kubeflow), 4);
        let script = with_env(&[("NPROC_PER_NODE", "5")]);
        assert_eq!(ranks(json!({}), script), 5);
        // The environment comes before the command line.
        let env_and_command = merged(
            with_env(&[("NPROC_PER_NODE", "5")]),
            json!({"command": ["torchrun", "--nproc-per-node=8", "train.py"]}),
        );
        assert_eq!(ranks(json!({}), env_and_command), 5);
    }

    #[test]
    fn then_the_torchrun_command_line() {
        let cases = [
            (
                json!({"command": ["torchrun", "--nproc-per-node", "8", "train.py"]}),
                8,
            ),
            (
                json!({"command": ["python", "-m", "torch.distributed.run"],
                       "args": ["--nproc_per_node=4", "train.py"]}),
                4,
            ),
            (
                json!({"command": ["/bin/bash", "-c"],
                       "args": ["pip install -e . && torchrun --nproc-per-node=2 train.py"]}),
                2,
            ),
            (
                json!({"args": ["/usr/local/bin/torchrun", "--nproc_per_node", "6", "t.py"]}),
                6,
            ),
            // A script's own flag, with no launcher before it, says nothing.
            (
                json!({"command": ["python", "train.py", "--nproc-per-node", "8"]}),
                1,
            ),
        ];
        for (container, want) in cases {
            assert_eq!(ranks(json!({}), container.clone()), want, "{container}");
        }
    }

    #[test]
    fn gpu_auto_or_nothing_mean_one_per_gpu() {
        let auto = merged(with_env(&[("PET_NPROC_PER_NODE", "auto")]), gpus(4));
        assert_eq!(ranks(json!({}), auto), 4);
        let gpu = merged(
            json!({"command": ["torchrun", "--nproc-per-node", "gpu", "t.py"]}),
            gpus(8),
        );
        assert_eq!(ranks(json!({}), gpu), 8);
        // `gpu` answers: a later source is not read.
        let first = merged(
            merged(with_env(&[("LOCAL_WORLD_SIZE", "gpu")]), gpus(2)),
            json!({"command": ["torchrun", "--nproc-per-node", "8", "t.py"]}),
        );
        assert_eq!(ranks(json!({}), first), 2);
        assert_eq!(ranks(json!({}), gpus(8)), 8);
        assert_eq!(ranks(json!({}), gpus(1)), 1);
        assert_eq!(ranks(json!({}), json!({})), 1);
        assert_eq!(
            ranks(json!({}), with_env(&[("LOCAL_WORLD_SIZE", "auto")])),
            1
        );
    }

    #[test]
    fn a_variable_is_left_to_the_next_source() {
        let env_var = merged(
            with_env(&[("NPROC_PER_NODE", "$(GPUS)")]),
            json!({"command": ["torchrun", "--nproc-per-node", "4", "t.py"]}),
        );
        assert_eq!(ranks(json!({}), env_var), 4);
        let shell_var = merged(
            json!({"command": ["sh", "-c", "torchrun --nproc-per-node=$NPROC t.py"]}),
            gpus(2),
        );
        assert_eq!(ranks(json!({}), shell_var), 2);
    }

    #[test]
    fn an_unreadable_count_names_where_it_came_from() {
        let refused = |annotations: Value, container: Value| {
            local_ranks(&pod(annotations, container))
                .expect_err("refused")
                .to_string()
        };
        let message = refused(json!({"stoker.dev/local-ranks": "eight"}), gpus(8));
        assert!(
            message.starts_with("the annotation stoker.dev/local-ranks is \"eight\""),
            "{message}"
        );
        let message = refused(json!({}), with_env(&[("LOCAL_WORLD_SIZE", "0")]));
        assert!(
            message.starts_with("env LOCAL_WORLD_SIZE of container \"trainer\" is \"0\""),
            "{message}"
        );
        let message = refused(
            json!({}),
            json!({"command": ["torchrun", "--nproc_per_node=lots", "t.py"]}),
        );
        assert!(
            message.starts_with(
                "--nproc-per-node in the command of container \"trainer\" is \"lots\""
            ),
            "{message}"
        );
        let message = refused(json!({"stoker.dev/local-ranks": "5000"}), json!({}));
        assert!(message.contains("1 to 1024"), "{message}");
        assert!(
            message.contains("say the number in the pod annotation stoker.dev/local-ranks"),
            "{message}"
        );
    }

    fn value<'a>(env: &'a [EnvVar], name: &str) -> Option<&'a str> {
        env.iter().find(|e| e.name == name)?.value.as_deref()
    }

    fn field_path<'a>(env: &'a [EnvVar], name: &str) -> Option<&'a str> {
        let from = env.iter().find(|e| e.name == name)?.value_from.as_ref()?;
        Some(from.field_ref.as_ref()?.field_path.as_str())
    }

    fn names(env: &[EnvVar]) -> Vec<&str> {
        env.iter().map(|e| e.name.as_str()).collect()
    }

    #[test]
    fn a_kubeflow_pytorchjob_pod_places_the_sidecar_by_its_node_rank() {
        // What Kubeflow's training operator sets on worker 2 of 3, four processes each.
        let kubeflow = [
            ("PET_NPROC_PER_NODE", "4"),
            ("PET_NODE_RANK", "2"),
            ("PET_NNODES", "3"),
            ("RANK", "2"),
            ("WORLD_SIZE", "12"),
        ];
        let p = pod(json!({}), with_env(&kubeflow));
        let n = local_ranks(&p).expect("derives");
        let env = rank_env(&p, n);
        // RANK is the pod's index, not a trainer's: the sidecar starts at node rank × 4.
        assert_eq!(names(&env), ["WORLD_SIZE", "STOKER_NODE_RANK"]);
        assert_eq!(value(&env, "WORLD_SIZE"), Some("12"));
        assert_eq!(value(&env, "STOKER_NODE_RANK"), Some("2"));

        // nprocPerNode `auto` (Kubeflow's default) on 8 GPUs: Kubeflow's WORLD_SIZE counts pods.
        let auto = [
            ("PET_NPROC_PER_NODE", "auto"),
            ("PET_NODE_RANK", "2"),
            ("PET_NNODES", "3"),
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
        ];
        let p = pod(json!({}), merged(with_env(&auto), gpus(8)));
        let n = local_ranks(&p).expect("derives");
        assert_eq!(n, 8);
        assert_eq!(value(&rank_env(&p, n), "WORLD_SIZE"), Some("24"));
        // Elastic (a range of nodes) says no world size; nor node rank: taken for one node.
        let p = pod(
            json!({}),
            with_env(&[("PET_NPROC_PER_NODE", "4"), ("PET_NNODES", "1:3")]),
        );
        assert_eq!(value(&rank_env(&p, 4), "WORLD_SIZE"), Some("4"));
    }

    #[test]
    fn an_indexed_job_pod_of_several_ranks_reads_its_node_rank_from_the_completion_index() {
        let p = pod(
            json!({JOB_COMPLETION_INDEX: "3", "stoker.dev/world-size": "32"}),
            gpus(8),
        );
        let env = rank_env(&p, local_ranks(&p).expect("derives"));
        assert_eq!(names(&env), ["WORLD_SIZE", "STOKER_NODE_RANK"]);
        assert_eq!(
            field_path(&env, "STOKER_NODE_RANK"),
            Some("metadata.annotations['batch.kubernetes.io/job-completion-index']")
        );
        assert_eq!(
            field_path(&env, "WORLD_SIZE"),
            Some("metadata.annotations['stoker.dev/world-size']")
        );
        // A node rank but no world size: left to the sidecar, which names the problem.
        let p = pod(json!({JOB_COMPLETION_INDEX: "3"}), gpus(8));
        assert_eq!(names(&rank_env(&p, 8)), ["STOKER_NODE_RANK"]);
    }

    #[test]
    fn a_node_rank_from_the_downward_api_is_copied() {
        let p = pod(
            json!({}),
            json!({"env": [
                {"name": "LOCAL_WORLD_SIZE", "value": "2"},
                {"name": "NODE_RANK",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['rank']"}}}
            ]}),
        );
        let env = rank_env(&p, 2);
        assert_eq!(
            field_path(&env, "STOKER_NODE_RANK"),
            Some("metadata.labels['rank']")
        );
        // No world size, a node rank: the sidecar's own default.
        assert_eq!(value(&env, "WORLD_SIZE"), None);
    }

    #[test]
    fn a_single_rank_pod_keeps_its_rank_and_local_rank() {
        let p = pod(
            json!({}),
            with_env(&[("RANK", "5"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "8")]),
        );
        let env = rank_env(&p, 1);
        assert_eq!(names(&env), ["RANK", "LOCAL_RANK", "WORLD_SIZE"]);
        assert_eq!(value(&env, "RANK"), Some("5"));
    }

    #[test]
    fn the_pods_own_fs_group_is_kept() {
        let mut own = PodSecurityContext {
            fs_group: Some(1000),
            ..PodSecurityContext::default()
        };
        share_ring_group(&mut own);
        assert_eq!(
            (own.fs_group, own.fs_group_change_policy),
            (Some(1000), None)
        );
        let mut none = PodSecurityContext::default();
        share_ring_group(&mut none);
        assert_eq!(none.fs_group, Some(SIDECAR_ID));
        assert_eq!(
            none.fs_group_change_policy.as_deref(),
            Some("OnRootMismatch")
        );
    }
}

#[cfg(test)]
mod instance_metadata_tests {
    use super::*;

    fn imds_off(dp: &DataPipeline) -> bool {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "t", "annotations": {"stoker.dev/local-ranks": "1"}},
            "spec": {"containers": [{"name": "trainer"}]}
        }))
        .expect("pod");
        let c = sidecar(&pod, dp, &BuildDefaults::default(), 1).expect("builds");
        c.env
            .expect("env")
            .iter()
            .any(|e| e.name == "AWS_EC2_METADATA_DISABLED" && e.value.as_deref() == Some("true"))
    }

    #[test]
    fn the_sidecar_uses_instance_metadata_only_when_the_pipeline_asks() {
        let mut dp: DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        assert!(imds_off(&dp));
        dp.spec.source.s3.use_instance_metadata = true;
        assert!(!imds_off(&dp));
    }
}
