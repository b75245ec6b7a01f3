//! Sidecar injection, pure: a trainer pod and its pipeline in, a JSON patch out. The sidecar
//! and its volume come from [`crate::build::sidecar`]; applying the patch to an already injected
//! pod yields an empty patch.

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;

use crate::api::{ANNOTATION_INJECTED, DataPipeline, LABEL_ROLE, ROLE_TRAINER};
use crate::build::BuildDefaults;
use crate::build::decoder_pod::{TLS_VOLUME, tls_volume};
use crate::build::sidecar::{
    LocalRanksError, SHM_VOLUME, SIDECAR_NAME, client_env, env, local_ranks, share_ring_group,
    shm_mount, shm_volume, sidecar,
};
use crate::build::sidecar_rbac::{SIDECAR_TOKEN_VOLUME, sidecar_token_volume};

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("pod could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error(transparent)]
    LoaderArgs(#[from] stoker_contract::RenderError),
    #[error(transparent)]
    LocalRanks(#[from] LocalRanksError),
}

impl InjectError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Serialize(_) => "serialize",
            Self::LoaderArgs(e) => e.category(),
            Self::LocalRanks(e) => e.category(),
        }
    }
}

/// The JSON patch that injects the loader sidecar into `pod` for `dp`.
pub fn injection_patch(
    pod: &Pod,
    dp: &DataPipeline,
    defaults: &BuildDefaults,
) -> Result<json_patch::Patch, InjectError> {
    let before = serde_json::to_value(pod)?;
    let after = serde_json::to_value(inject(pod.clone(), dp, defaults)?)?;
    Ok(json_patch::diff(&before, &after))
}

/// The injected pod. Each step adds only what is missing, which makes re-invocation a no-op.
pub fn inject(
    mut pod: Pod,
    dp: &DataPipeline,
    defaults: &BuildDefaults,
) -> Result<Pod, InjectError> {
    let pipeline = dp.name_any();
    // Decided once: the sidecar's rings and sockets, its memory and the volume all follow it.
    let local_ranks = local_ranks(&pod)?;
    let loader = sidecar(&pod, dp, defaults, local_ranks)?;
    pod.labels_mut()
        .entry(LABEL_ROLE.to_string())
        .or_insert_with(|| ROLE_TRAINER.to_string());
    pod.annotations_mut()
        .entry(ANNOTATION_INJECTED.to_string())
        .or_insert_with(|| "true".to_string());
    let Some(spec) = pod.spec.as_mut() else {
        return Ok(pod);
    };

    share_ring_group(spec.security_context.get_or_insert_with(Default::default));

    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    if !volumes.iter().any(|v| v.name == SHM_VOLUME) {
        volumes.push(shm_volume(dp, local_ranks));
    }
    // The pipeline's certificate, which the sidecar presents to its decoders.
    if !volumes.iter().any(|v| v.name == TLS_VOLUME) {
        volumes.push(tls_volume(dp));
    }
    // The sidecar's ServiceAccount token; only the sidecar mounts it.
    if !volumes.iter().any(|v| v.name == SIDECAR_TOKEN_VOLUME) {
        volumes.push(sidecar_token_volume(dp));
    }

    for c in &mut spec.containers {
        add_client_wiring(c, &pipeline);
    }

    let inits = spec.init_containers.get_or_insert_with(Vec::new);
    if !inits.iter().any(|c| c.name == SIDECAR_NAME) {
        // First, so that any later init container can already read batches.
        inits.insert(0, loader);
    }
    Ok(pod)
}

/// The trainer container's side of the contract: the rings mounted, and where to connect.
fn add_client_wiring(c: &mut Container, pipeline: &str) {
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    if !mounts.iter().any(|m| m.name == SHM_VOLUME) {
        mounts.push(shm_mount());
    }
    let envs = c.env.get_or_insert_with(Vec::new);
    for (k, v) in client_env(pipeline) {
        if !envs.iter().any(|e| e.name == k) {
            envs.push(env(k, v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ANNOTATION_WORLD_SIZE;
    use crate::build::sidecar::{SIDECAR_ID, quantity_bytes};
    use k8s_openapi::api::core::v1::{EnvVar, PodSecurityContext, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use stoker_contract::{ANNOTATION_LOCAL_RANKS, SHM_DIR};

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    /// A trainer with 8 GPUs (8 local ranks, one per GPU), a literal RANK and an init container.
    fn trainer() -> Pod {
        serde_yaml::from_str(include_str!("../../tests/fixtures/trainer-pod.yaml"))
            .expect("fixture")
    }

    /// The fixture as one trainer process.
    fn single_rank() -> Pod {
        let mut pod = trainer();
        pod.annotations_mut()
            .insert(ANNOTATION_LOCAL_RANKS.into(), "1".into());
        pod
    }

    fn cfg() -> BuildDefaults {
        BuildDefaults {
            loader_image: "loader:test".into(),
            sidecar_resources: None,
            allowed_images: Vec::new(),
        }
    }

    fn apply(pod: &Pod, patch: &json_patch::Patch) -> Pod {
        let mut v = serde_json::to_value(pod).expect("json");
        json_patch::patch(&mut v, patch).expect("patch applies");
        serde_json::from_value(v).expect("pod")
    }

    fn injected(pod: &Pod, defaults: &BuildDefaults) -> Pod {
        apply(pod, &injection_patch(pod, &dp(), defaults).expect("patch"))
    }

    fn shm_size(pod: &Pod) -> String {
        let volume = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == SHM_VOLUME))
            .expect("shm volume");
        let dir = volume.empty_dir.as_ref().expect("emptyDir");
        assert_eq!(dir.medium.as_deref(), Some("Memory"));
        dir.size_limit.as_ref().expect("sizeLimit").0.clone()
    }

    fn with_resources() -> BuildDefaults {
        use std::collections::BTreeMap;
        let q = |s: &str| Quantity(s.to_string());
        let both = BTreeMap::from([
            ("cpu".to_string(), q("1")),
            ("memory".to_string(), q("512Mi")),
        ]);
        BuildDefaults {
            sidecar_resources: Some(ResourceRequirements {
                requests: Some(both.clone()),
                limits: Some(both),
                ..ResourceRequirements::default()
            }),
            ..cfg()
        }
    }

    #[test]
    fn injects_a_native_sidecar_before_existing_init_containers() {
        let pod = injected(&trainer(), &cfg());
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
        for c in &spec.containers {
            let env = c.env.as_ref().expect("env");
            assert!(
                env.iter()
                    .any(|e| e.name == "STOKER_SHM_DIR" && e.value.as_deref() == Some(SHM_DIR))
            );
            assert!(
                env.iter().any(|e| e.name == "STOKER_PIPELINE"
                    && e.value.as_deref() == Some("qwen3vl-pretrain"))
            );
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
    fn a_torchrun_pod_gets_a_ring_and_a_socket_per_local_rank() {
        let mut pod = trainer();
        pod.spec.as_mut().expect("spec").containers[0].command = Some(
            ["torchrun", "--nproc-per-node", "8", "train.py"]
                .map(String::from)
                .to_vec(),
        );
        let pod = injected(&pod, &with_resources());
        let spec = pod.spec.as_ref().expect("spec");
        let sidecar = &spec.init_containers.as_ref().expect("inits")[0];
        let env = sidecar.env.clone().expect("env");
        let value = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(value("STOKER_LOCAL_RANKS").as_deref(), Some("8"));
        // The trainer's RANK=0 is torchrun's to set per process: the sidecar starts at node
        // rank 0 × 8, in a job of one node.
        assert_eq!(value("RANK"), None);
        assert_eq!(value("WORLD_SIZE").as_deref(), Some("8"));

        // No single socket anywhere: the sidecar names stoker-<local rank>.sock in the shm dir.
        let args = sidecar.args.clone().expect("args").join(" ");
        assert!(!args.contains("--socket"), "{args}");
        assert!(args.contains(&format!("--shm-dir {SHM_DIR}")), "{args}");
        for c in spec.containers.iter().chain([sidecar]) {
            assert!(
                c.env.iter().flatten().all(|e| e.name != "STOKER_SOCKET"),
                "{}",
                c.name
            );
        }

        // Eight of the pipeline's 2Gi rings, in the volume and on the sidecar's memory.
        let rings = 8 * (2u64 << 30);
        assert_eq!(shm_size(&pod), rings.to_string());
        let r = sidecar.resources.as_ref().expect("resources");
        let memory = ((512u64 << 20) + rings).to_string();
        assert_eq!(r.limits.as_ref().expect("limits")["memory"].0, memory);
        assert_eq!(r.requests.as_ref().expect("requests")["memory"].0, memory);
        assert_eq!(r.limits.as_ref().expect("limits")["cpu"].0, "1");

        // A non-root trainer shares the sidecar's group: the rings and sockets are 0660.
        let security = spec.security_context.as_ref().expect("pod security");
        assert_eq!(security.fs_group, Some(SIDECAR_ID));
        assert_eq!(
            security.fs_group_change_policy.as_deref(),
            Some("OnRootMismatch")
        );
        let own = sidecar.security_context.as_ref().expect("security");
        assert_eq!(
            (own.run_as_user, own.run_as_group),
            (Some(SIDECAR_ID), Some(SIDECAR_ID))
        );
    }

    #[test]
    fn a_pods_own_fs_group_is_kept() {
        let mut pod = trainer();
        pod.spec.as_mut().expect("spec").security_context = Some(PodSecurityContext {
            fs_group: Some(2000),
            run_as_user: Some(1000),
            ..PodSecurityContext::default()
        });
        let security = injected(&pod, &cfg())
            .spec
            .and_then(|s| s.security_context)
            .expect("security");
        assert_eq!(security.fs_group, Some(2000));
        assert_eq!(security.fs_group_change_policy, None);
        assert_eq!(security.run_as_user, Some(1000));
    }

    #[test]
    fn an_unreadable_local_rank_count_is_refused_naming_its_source() {
        let mut pod = trainer();
        pod.annotations_mut()
            .insert(ANNOTATION_LOCAL_RANKS.into(), "eight".into());
        let err = injection_patch(&pod, &dp(), &cfg()).expect_err("refused");
        assert_eq!(err.category(), "local_ranks");
        let message = err.to_string();
        assert!(
            message.contains("the annotation stoker.dev/local-ranks is \"eight\""),
            "{message}"
        );
    }

    #[test]
    fn works_without_init_containers_or_volumes() {
        let mut pod = trainer();
        let spec = pod.spec.as_mut().expect("spec");
        spec.init_containers = None;
        spec.volumes = None;
        let inits = injected(&pod, &cfg())
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.clone())
            .expect("inits");
        assert_eq!(inits.len(), 1);
    }

    fn sidecar_env(pod: &Pod) -> Vec<EnvVar> {
        let spec = injected(pod, &cfg()).spec.expect("spec");
        spec.init_containers.expect("inits")[0]
            .env
            .clone()
            .expect("env")
    }

    #[test]
    fn the_sidecar_learns_the_trainers_rank_and_world_size() {
        // The fixture's trainer sets RANK=0 itself.
        let env = sidecar_env(&single_rank());
        let rank = env.iter().find(|e| e.name == "RANK").expect("RANK");
        assert_eq!(rank.value.as_deref(), Some("0"));

        // An Indexed Job pod: the rank comes from its completion index, the world size from ours.
        let mut pod = single_rank();
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
    fn a_single_rank_pod_gets_one_ring() {
        let pod = injected(&single_rank(), &with_resources());
        // The pipeline's own spelling of one ring.
        assert_eq!(shm_size(&pod), "2Gi");
        let spec = pod.spec.expect("spec");
        let sidecar = &spec.init_containers.expect("inits")[0];
        let limits = sidecar
            .resources
            .as_ref()
            .and_then(|r| r.limits.clone())
            .expect("limits");
        assert_eq!(
            limits["memory"].0,
            ((512u64 << 20) + (2u64 << 30)).to_string()
        );
        let local_ranks = sidecar
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "STOKER_LOCAL_RANKS")
            .and_then(|e| e.value.clone());
        assert_eq!(local_ranks.as_deref(), Some("1"));
    }

    #[test]
    fn reads_quantities() {
        assert_eq!(quantity_bytes("2Gi"), Some(2 << 30));
        assert_eq!(quantity_bytes("1.5Mi"), Some(1_572_864));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("1024"), Some(1024));
        assert_eq!(quantity_bytes("1e3"), Some(1000));
        assert_eq!(quantity_bytes("two gigs"), None);
    }

    #[test]
    fn reinvocation_is_a_no_op() {
        for pod in [trainer(), single_rank()] {
            let once = injected(&pod, &with_resources());
            let again = injection_patch(&once, &dp(), &with_resources()).expect("patch");
            assert!(again.0.is_empty(), "second patch: {again:?}");
        }
    }

    #[test]
    fn keeps_the_users_own_env() {
        let mut pod = trainer();
        pod.spec.as_mut().expect("spec").containers[0]
            .env
            .get_or_insert_with(Vec::new)
            .push(env("STOKER_PIPELINE", "other"));
        let env = injected(&pod, &cfg()).spec.expect("spec").containers[0]
            .env
            .clone()
            .expect("env");
        let pipelines: Vec<_> = env.iter().filter(|e| e.name == "STOKER_PIPELINE").collect();
        assert_eq!(pipelines.len(), 1);
        assert_eq!(pipelines[0].value.as_deref(), Some("other"));
    }
}
