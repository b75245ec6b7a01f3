//! The loader sidecar the webhook injects into a trainer pod, and the pieces of the trainer
//! pod it needs: the memory-backed ring volume and the trainer containers' wiring.
//!
//! The loader runs as a native sidecar (an init container with `restartPolicy: Always`) whose
//! startup probe passes once its unix socket listens, so the trainer containers start only when
//! they can connect.

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, Pod, Probe, ResourceRequirements, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube_quantity::ParsedQuantity;
use stoker_contract::{
    RenderError, SHM_DIR, SIDECAR_HEALTH_PORT, SOCKET_PATH, env as contract_env,
};

use super::decoder_pod::credentials_env_from;
use super::{BuildDefaults, restricted_security_context};
use crate::api::{ANNOTATION_RANK, ANNOTATION_WORLD_SIZE, DataPipeline};

pub const SIDECAR_NAME: &str = "stoker-loader";
pub const SHM_VOLUME: &str = "stoker-shm";

/// Where a trainer pod's rank comes from when its containers do not set `RANK`: our own
/// annotation, else the completion index of an Indexed Job (JobSet, torchrun on Jobs).
pub const RANK_SOURCES: [&str; 2] = [ANNOTATION_RANK, "batch.kubernetes.io/job-completion-index"];

/// The memory-backed volume the ring lives in, sized by `trainer.sharedMemory`.
pub fn shm_volume(dp: &DataPipeline) -> Volume {
    Volume {
        name: SHM_VOLUME.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".to_string()),
            size_limit: Some(Quantity(dp.spec.trainer.shared_memory.clone())),
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

pub fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        ..EnvVar::default()
    }
}

/// What a trainer container needs to find the sidecar: (name, value) of its environment.
pub fn client_env(pipeline: &str) -> [(&'static str, &str); 3] {
    [
        (contract_env::SOCKET, SOCKET_PATH),
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

/// `RANK`, `WORLD_SIZE` and `LOCAL_RANK` for the sidecar, which shards the epoch by them: copied
/// from the trainer containers' own definitions (literal or downward API), else read through
/// the downward API from the pod's annotations.
fn rank_env(pod: &Pod) -> Vec<EnvVar> {
    let defined = |name: &str| {
        pod.spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.env.iter().flatten())
            .find(|e| e.name == name)
            .cloned()
    };
    let annotated = |key: &str| pod.annotations().contains_key(key);
    let from_annotation =
        |name: &str, key: &str| field_env(name, &format!("metadata.annotations['{key}']"));
    let mut out = Vec::new();
    match defined("RANK") {
        Some(e) => out.push(e),
        None => {
            if let Some(key) = RANK_SOURCES.into_iter().find(|k| annotated(k)) {
                out.push(from_annotation("RANK", key));
            }
        }
    }
    match defined("WORLD_SIZE") {
        Some(e) => out.push(e),
        None if annotated(ANNOTATION_WORLD_SIZE) => {
            out.push(from_annotation("WORLD_SIZE", ANNOTATION_WORLD_SIZE));
        }
        None => {}
    }
    out.extend(defined("LOCAL_RANK"));
    out
}

/// Bytes of a Kubernetes quantity; `None` when it does not parse (then the ring is not added
/// to the sidecar's memory). Through f64: the crate's integer conversion drops the fraction
/// before scaling ("1.5Mi" would be 1Mi); sizes stay far below 2^53.
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let bytes = ParsedQuantity::try_from(q).ok()?.to_bytes_f64()?;
    (bytes.is_finite() && bytes >= 0.0).then(|| bytes.ceil() as u64)
}

/// The sidecar's resources: the operator's base plus the shared-memory ring on memory, since
/// tmpfs pages the sidecar writes are charged to its cgroup. Requests equal limits where the
/// base sets both, so a Guaranteed trainer pod stays Guaranteed.
fn sidecar_resources(base: &ResourceRequirements, shared_memory: &str) -> ResourceRequirements {
    let mut r = base.clone();
    let Some(ring) = quantity_bytes(shared_memory) else {
        return r;
    };
    for list in [r.requests.as_mut(), r.limits.as_mut()]
        .into_iter()
        .flatten()
    {
        if let Some(mem) = list.get_mut("memory")
            && let Some(b) = quantity_bytes(&mem.0)
        {
            *mem = Quantity((b + ring).to_string());
        }
    }
    r
}

/// The loader sidecar container for `pod`, a trainer of `dp`.
pub fn sidecar(
    pod: &Pod,
    dp: &DataPipeline,
    defaults: &BuildDefaults,
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
    security.run_as_user = Some(65532);
    Ok(Container {
        name: SIDECAR_NAME.to_string(),
        image: Some(defaults.loader_image(dp)),
        args: Some(super::loader_args::sidecar_args(dp)?),
        restart_policy: Some("Always".to_string()),
        env: Some(
            [
                field_env(contract_env::POD_NAME, "metadata.name"),
                field_env(contract_env::NODE_NAME, "spec.nodeName"),
                env(contract_env::SOCKET, SOCKET_PATH),
                env(contract_env::SHM_DIR, SHM_DIR),
            ]
            .into_iter()
            .chain(rank_env(pod))
            .collect(),
        ),
        env_from: credentials_env_from(dp),
        ports: Some(vec![ContainerPort {
            name: Some("stoker-metrics".to_string()),
            container_port: i32::from(SIDECAR_HEALTH_PORT),
            protocol: Some("TCP".to_string()),
            ..ContainerPort::default()
        }]),
        // The trainer containers start only after this passes: the socket is listening.
        startup_probe: Some(probe(1, 600)),
        readiness_probe: Some(probe(5, 3)),
        resources: defaults
            .sidecar_resources
            .as_ref()
            .map(|base| sidecar_resources(base, &dp.spec.trainer.shared_memory)),
        security_context: Some(security),
        volume_mounts: Some(vec![shm_mount()]),
        ..Container::default()
    })
}
