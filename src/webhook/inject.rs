//! Sidecar injection, pure: a trainer pod and its pipeline in, a JSON patch out.
//!
//! The loader runs as a native sidecar (an init container with `restartPolicy: Always`) whose
//! startup probe passes once its unix socket listens, so the trainer containers start only when
//! they can connect. Applying the patch to an already injected pod yields an empty patch.

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, Pod, Probe, ResourceRequirements, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use crate::api::{
    ANNOTATION_INJECTED, ANNOTATION_RANK, ANNOTATION_WORLD_SIZE, DataPipeline, LABEL_ROLE,
    ROLE_TRAINER,
};
use crate::controller::build::decoder_pod::{credentials_env_from, restricted_security_context};
use crate::controller::build::{CONFIG_DIR, config_map_name, decoder_discovery_selector};

pub const SIDECAR_NAME: &str = "stoker-loader";
pub const SHM_VOLUME: &str = "stoker-shm";
pub const CONFIG_VOLUME: &str = "stoker-config";
/// Where the shared-memory ring lives, in the sidecar and in every trainer container.
pub const SHM_DIR: &str = "/dev/shm/stoker";
/// The unix socket the trainer's `stoker` client connects to.
pub const SOCKET_PATH: &str = "/dev/shm/stoker/stoker.sock";
/// The sidecar's metrics and readiness port; `/readyz` passes once the socket listens.
pub const SIDECAR_HEALTH_PORT: i32 = 9091;

/// Operator-wide inputs to injection.
#[derive(Clone, Debug)]
pub struct InjectConfig {
    pub loader_image: String,
    pub sidecar_resources: Option<ResourceRequirements>,
}

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("pod could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
}

impl InjectError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Serialize(_) => "serialize",
        }
    }
}

/// The JSON patch that injects the loader sidecar into `pod` for `dp`.
pub fn injection_patch(
    pod: &Pod,
    dp: &DataPipeline,
    cfg: &InjectConfig,
) -> Result<json_patch::Patch, InjectError> {
    let before = serde_json::to_value(pod)?;
    let after = serde_json::to_value(inject(pod.clone(), dp, cfg))?;
    Ok(json_patch::diff(&before, &after))
}

/// The injected pod. Each step adds only what is missing, which makes re-invocation a no-op.
pub fn inject(mut pod: Pod, dp: &DataPipeline, cfg: &InjectConfig) -> Pod {
    let pipeline = dp.name_any();
    let loader = sidecar(&pod, dp, cfg);
    pod.labels_mut()
        .entry(LABEL_ROLE.to_string())
        .or_insert_with(|| ROLE_TRAINER.to_string());
    pod.annotations_mut()
        .entry(ANNOTATION_INJECTED.to_string())
        .or_insert_with(|| "true".to_string());
    let Some(spec) = pod.spec.as_mut() else {
        return pod;
    };

    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    if !volumes.iter().any(|v| v.name == SHM_VOLUME) {
        volumes.push(Volume {
            name: SHM_VOLUME.to_string(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".to_string()),
                size_limit: Some(Quantity(dp.spec.trainer.shared_memory.clone())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    if !volumes.iter().any(|v| v.name == CONFIG_VOLUME) {
        volumes.push(Volume {
            name: CONFIG_VOLUME.to_string(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map_name(&pipeline),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        });
    }

    for c in &mut spec.containers {
        add_client_wiring(c, &pipeline);
    }

    let inits = spec.init_containers.get_or_insert_with(Vec::new);
    if !inits.iter().any(|c| c.name == SIDECAR_NAME) {
        // First, so that any later init container can already read batches.
        inits.insert(0, loader);
    }
    pod
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        ..EnvVar::default()
    }
}

fn shm_mount() -> VolumeMount {
    VolumeMount {
        name: SHM_VOLUME.to_string(),
        mount_path: SHM_DIR.to_string(),
        ..VolumeMount::default()
    }
}

/// The trainer container's side of the contract: the ring mounted, and where to connect.
fn add_client_wiring(c: &mut Container, pipeline: &str) {
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    if !mounts.iter().any(|m| m.name == SHM_VOLUME) {
        mounts.push(shm_mount());
    }
    let envs = c.env.get_or_insert_with(Vec::new);
    for (k, v) in [
        ("STOKER_SOCKET", SOCKET_PATH),
        ("STOKER_SHM_DIR", SHM_DIR),
        ("STOKER_PIPELINE", pipeline),
    ] {
        if !envs.iter().any(|e| e.name == k) {
            envs.push(env(k, v));
        }
    }
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

/// Where a trainer pod's rank comes from when its containers do not set `RANK`: our own
/// annotation, else the completion index of an Indexed Job (JobSet, torchrun on Jobs).
pub const RANK_SOURCES: [&str; 2] = [ANNOTATION_RANK, "batch.kubernetes.io/job-completion-index"];

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

/// Bytes of a Kubernetes quantity with a binary or decimal suffix; `None` for forms this
/// does not read (then the ring is not added to the sidecar's memory).
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let factor: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    let n: f64 = number.parse().ok()?;
    (n >= 0.0).then(|| (n * factor as f64).ceil() as u64)
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

/// The loader sidecar container.
pub fn sidecar(pod: &Pod, dp: &DataPipeline, cfg: &InjectConfig) -> Container {
    let pipeline = dp.name_any();
    let probe = |period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/readyz".to_string()),
            port: IntOrString::Int(SIDECAR_HEALTH_PORT),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let args = crate::controller::build::loader_args::sidecar_args(
        dp,
        &decoder_discovery_selector(&pipeline),
        SOCKET_PATH,
        SHM_DIR,
        SIDECAR_HEALTH_PORT,
    );
    let mut security = restricted_security_context();
    security.run_as_user = Some(65532);
    Container {
        name: SIDECAR_NAME.to_string(),
        image: Some(
            dp.spec
                .decoders
                .image
                .clone()
                .unwrap_or_else(|| cfg.loader_image.clone()),
        ),
        args: Some(args),
        restart_policy: Some("Always".to_string()),
        env: Some(
            [
                field_env("STOKER_POD_NAME", "metadata.name"),
                field_env("STOKER_NODE_NAME", "spec.nodeName"),
                env("STOKER_SOCKET", SOCKET_PATH),
                env("STOKER_SHM_DIR", SHM_DIR),
            ]
            .into_iter()
            .chain(rank_env(pod))
            .collect(),
        ),
        env_from: credentials_env_from(dp),
        ports: Some(vec![k8s_openapi::api::core::v1::ContainerPort {
            name: Some("stoker-metrics".to_string()),
            container_port: SIDECAR_HEALTH_PORT,
            protocol: Some("TCP".to_string()),
            ..Default::default()
        }]),
        // The trainer containers start only after this passes: the socket is listening.
        startup_probe: Some(probe(1, 600)),
        readiness_probe: Some(probe(5, 3)),
        resources: cfg
            .sidecar_resources
            .as_ref()
            .map(|base| sidecar_resources(base, &dp.spec.trainer.shared_memory)),
        security_context: Some(security),
        volume_mounts: Some(vec![
            shm_mount(),
            VolumeMount {
                name: CONFIG_VOLUME.to_string(),
                mount_path: CONFIG_DIR.to_string(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
        ]),
        ..Container::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    fn trainer() -> Pod {
        serde_yaml::from_str(include_str!("../../tests/fixtures/trainer-pod.yaml"))
            .expect("fixture")
    }

    fn cfg() -> InjectConfig {
        InjectConfig {
            loader_image: "loader:test".into(),
            sidecar_resources: None,
        }
    }

    fn apply(pod: &Pod, patch: &json_patch::Patch) -> Pod {
        let mut v = serde_json::to_value(pod).expect("json");
        json_patch::patch(&mut v, patch).expect("patch applies");
        serde_json::from_value(v).expect("pod")
    }

    #[test]
    fn injects_a_native_sidecar_before_existing_init_containers() {
        let patch = injection_patch(&trainer(), &dp(), &cfg()).expect("patch");
        let pod = apply(&trainer(), &patch);
        let spec = pod.spec.as_ref().expect("spec");
        let inits = spec.init_containers.as_ref().expect("inits");
        assert_eq!(
            inits.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            [SIDECAR_NAME, "fetch-checkpoint"]
        );
        let sidecar = &inits[0];
        assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
        let startup = sidecar
            .startup_probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .expect("startup probe");
        assert_eq!(startup.path.as_deref(), Some("/readyz"));
        let args = sidecar.args.clone().expect("args").join(" ");
        assert!(args.starts_with("sidecar --bucket "), "{args}");
        assert!(args.contains(
            "--workers-selector stoker.dev/pipeline=qwen3vl-pretrain,stoker.dev/role=decoder"
        ));
        assert!(args.contains("--workers-namespace training"), "{args}");
        let shm = spec
            .volumes
            .as_ref()
            .expect("volumes")
            .iter()
            .find(|v| v.name == SHM_VOLUME)
            .expect("shm");
        let dir = shm.empty_dir.as_ref().expect("emptyDir");
        assert_eq!(dir.medium.as_deref(), Some("Memory"));
        assert_eq!(dir.size_limit.as_ref().map(|q| q.0.as_str()), Some("2Gi"));
        for c in &spec.containers {
            let env = c.env.as_ref().expect("env");
            assert!(
                env.iter()
                    .any(|e| e.name == "STOKER_SOCKET" && e.value.as_deref() == Some(SOCKET_PATH))
            );
            assert!(env.iter().any(|e| e.name == "STOKER_SHM_DIR"));
            assert!(
                c.volume_mounts
                    .as_ref()
                    .expect("mounts")
                    .iter()
                    .any(|m| m.mount_path == SHM_DIR)
            );
        }
        assert_eq!(pod.labels()[LABEL_ROLE], ROLE_TRAINER);
        assert_eq!(pod.annotations()[ANNOTATION_INJECTED], "true");
    }

    #[test]
    fn works_without_init_containers_or_volumes() {
        let mut pod = trainer();
        let spec = pod.spec.as_mut().expect("spec");
        spec.init_containers = None;
        spec.volumes = None;
        let patched = apply(&pod, &injection_patch(&pod, &dp(), &cfg()).expect("patch"));
        let inits = patched
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.clone())
            .expect("inits");
        assert_eq!(inits.len(), 1);
    }

    fn sidecar_env(pod: &Pod) -> Vec<EnvVar> {
        let patched = apply(pod, &injection_patch(pod, &dp(), &cfg()).expect("patch"));
        let spec = patched.spec.expect("spec");
        spec.init_containers.expect("inits")[0]
            .env
            .clone()
            .expect("env")
    }

    #[test]
    fn the_sidecar_learns_the_trainers_rank_and_world_size() {
        // The fixture's trainer sets RANK=0 itself.
        let env = sidecar_env(&trainer());
        let rank = env.iter().find(|e| e.name == "RANK").expect("RANK");
        assert_eq!(rank.value.as_deref(), Some("0"));

        // An Indexed Job pod: the rank comes from its completion index, the world size from ours.
        let mut pod = trainer();
        pod.spec.as_mut().expect("spec").containers[0].env = None;
        pod.annotations_mut().insert(
            "batch.kubernetes.io/job-completion-index".into(),
            "3".into(),
        );
        pod.annotations_mut()
            .insert(ANNOTATION_WORLD_SIZE.into(), "8".into());
        let env = sidecar_env(&pod);
        let path = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.clone())
        };
        assert_eq!(
            path("RANK").as_deref(),
            Some("metadata.annotations['batch.kubernetes.io/job-completion-index']")
        );
        assert_eq!(
            path("WORLD_SIZE").as_deref(),
            Some("metadata.annotations['stoker.dev/world-size']")
        );
    }

    #[test]
    fn the_sidecar_memory_covers_the_ring() {
        use std::collections::BTreeMap;
        let q = |s: &str| Quantity(s.to_string());
        let mut c = cfg();
        let both = BTreeMap::from([
            ("cpu".to_string(), q("1")),
            ("memory".to_string(), q("512Mi")),
        ]);
        c.sidecar_resources = Some(ResourceRequirements {
            requests: Some(both.clone()),
            limits: Some(both),
            ..ResourceRequirements::default()
        });
        let pod = apply(
            &trainer(),
            &injection_patch(&trainer(), &dp(), &c).expect("patch"),
        );
        let sidecar = &pod.spec.expect("spec").init_containers.expect("inits")[0];
        let r = sidecar.resources.as_ref().expect("resources");
        // 512Mi + the fixture's 2Gi ring.
        let want = ((512u64 << 20) + (2u64 << 30)).to_string();
        assert_eq!(r.limits.as_ref().expect("limits")["memory"].0, want);
        assert_eq!(r.requests.as_ref().expect("requests")["memory"].0, want);
        assert_eq!(r.limits.as_ref().expect("limits")["cpu"].0, "1");
    }

    #[test]
    fn reads_quantities() {
        assert_eq!(quantity_bytes("2Gi"), Some(2 << 30));
        assert_eq!(quantity_bytes("1.5Mi"), Some(1_572_864));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("1024"), Some(1024));
        assert_eq!(quantity_bytes("1e3"), None);
    }

    #[test]
    fn reinvocation_is_a_no_op() {
        let once = apply(
            &trainer(),
            &injection_patch(&trainer(), &dp(), &cfg()).expect("patch"),
        );
        let again = injection_patch(&once, &dp(), &cfg()).expect("patch");
        assert!(again.0.is_empty(), "second patch: {again:?}");
    }

    #[test]
    fn keeps_the_users_own_env() {
        let mut pod = trainer();
        pod.spec.as_mut().expect("spec").containers[0]
            .env
            .get_or_insert_with(Vec::new)
            .push(env("STOKER_SOCKET", "/custom.sock"));
        let patched = apply(&pod, &injection_patch(&pod, &dp(), &cfg()).expect("patch"));
        let env = patched.spec.expect("spec").containers[0]
            .env
            .clone()
            .expect("env");
        let sockets: Vec<_> = env.iter().filter(|e| e.name == "STOKER_SOCKET").collect();
        assert_eq!(sockets.len(), 1);
        assert_eq!(sockets[0].value.as_deref(), Some("/custom.sock"));
    }
}
