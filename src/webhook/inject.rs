//! Sidecar injection, pure: a trainer pod and its pipeline in, a JSON patch out. The sidecar
//! and its volume come from [`crate::build::sidecar`]; applying the patch to an already injected
//! pod yields an empty patch.

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;

use crate::api::{ANNOTATION_INJECTED, DataPipeline, LABEL_ROLE, ROLE_TRAINER};
use crate::build::BuildDefaults;
use crate::build::sidecar::{
    SHM_VOLUME, SIDECAR_NAME, client_env, env, shm_mount, shm_volume, sidecar,
};

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("pod could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error(transparent)]
    LoaderArgs(#[from] stoker_contract::RenderError),
}

impl InjectError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Serialize(_) => "serialize",
            Self::LoaderArgs(e) => e.category(),
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
    let loader = sidecar(&pod, dp, defaults)?;
    pod.labels_mut()
        .entry(LABEL_ROLE.to_string())
        .or_insert_with(|| ROLE_TRAINER.to_string());
    pod.annotations_mut()
        .entry(ANNOTATION_INJECTED.to_string())
        .or_insert_with(|| "true".to_string());
    let Some(spec) = pod.spec.as_mut() else {
        return Ok(pod);
    };

    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    if !volumes.iter().any(|v| v.name == SHM_VOLUME) {
        volumes.push(shm_volume(dp));
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

/// The trainer container's side of the contract: the ring mounted, and where to connect.
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
    use crate::build::sidecar::quantity_bytes;
    use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use stoker_contract::{SHM_DIR, SOCKET_PATH};

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    fn trainer() -> Pod {
        serde_yaml::from_str(include_str!("../../tests/fixtures/trainer-pod.yaml"))
            .expect("fixture")
    }

    fn cfg() -> BuildDefaults {
        BuildDefaults {
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
        assert_eq!(quantity_bytes("1e3"), Some(1000));
        assert_eq!(quantity_bytes("two gigs"), None);
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
