//! Pure builders: one per object stoker makes for a `DataPipeline` — the decoder pod, the
//! trainer's sidecar container, the decoders' Service and NetworkPolicy, the sidecar's RBAC —
//! and the loader command lines they run. The controller and the webhook both use them; none
//! touches the network.

pub mod decoder_pod;
pub mod index_job;
pub mod loader_args;
pub mod network_policy;
pub mod service;
pub mod sidecar;
pub mod sidecar_rbac;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, PodSecurityContext, ResourceRequirements, SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_DECODER};

/// Operator-wide inputs to the builders.
#[derive(Clone, Debug)]
pub struct BuildDefaults {
    /// The stoker-loader image of decoders and sidecars unless the pipeline names one.
    pub loader_image: String,
    /// The injected sidecar's resources before its shared-memory ring is added to memory;
    /// `None` sets none.
    pub sidecar_resources: Option<ResourceRequirements>,
    /// Images an admin allows besides `loader_image` (the chart's `decoders.allowedImages`);
    /// `*` matches any run of characters. Empty allows the operator's own image only.
    pub allowed_images: Vec<String>,
}

impl Default for BuildDefaults {
    fn default() -> Self {
        Self {
            loader_image: "ghcr.io/stoker-dev/stoker-loader:0.1.0".into(),
            sidecar_resources: None,
            allowed_images: Vec::new(),
        }
    }
}

impl BuildDefaults {
    /// The loader image of `dp`'s decoders and sidecars.
    pub fn loader_image(&self, dp: &DataPipeline) -> String {
        dp.spec
            .decoders
            .image
            .clone()
            .unwrap_or_else(|| self.loader_image.clone())
    }

    /// Whether decoders and sidecars may run `image`: the operator's own loader image, or one
    /// an allowed pattern matches.
    pub fn image_allowed(&self, image: &str) -> bool {
        image == self.loader_image || self.allowed_images.iter().any(|p| glob(p, image))
    }

    /// Why `spec`'s decoders may not run their image here, if they may not.
    pub fn image_refusal(&self, spec: &crate::api::DataPipelineSpec) -> Option<String> {
        let image = spec.decoders.image.as_deref()?;
        (!self.image_allowed(image)).then(|| {
            format!("decoders.image: {image} is not an image this installation allows (the chart's decoders.allowedImages)")
        })
    }
}

/// Whether `text` matches `pattern`, where `*` stands for any run of characters (none too).
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return text.is_empty();
    };
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let middle: Vec<&str> = parts.collect();
    let Some((last, between)) = middle.split_last() else {
        return rest.is_empty();
    };
    for part in between {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

pub fn decoder_service_name(dp: &DataPipeline) -> String {
    format!("{}-decoders", dp.name_any())
}

pub fn network_policy_name(dp: &DataPipeline) -> String {
    format!("{}-decoders", dp.name_any())
}

pub fn sidecar_rbac_name(pipeline: &str) -> String {
    format!("stoker-{pipeline}-sidecar")
}

/// Labels every decoder of the pipeline carries (the selector of its Service and spread).
pub fn decoder_selector_labels(pipeline: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_PIPELINE.to_string(), pipeline.to_string()),
        (LABEL_ROLE.to_string(), ROLE_DECODER.to_string()),
    ])
}

/// Labels on every object the operator creates for a pipeline.
pub fn common_labels(dp: &DataPipeline) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_PIPELINE.to_string(), dp.name_any()),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "stoker-operator".to_string(),
        ),
        (
            "app.kubernetes.io/part-of".to_string(),
            "stoker".to_string(),
        ),
    ])
}

/// Metadata of a child: name, namespace, labels, and a controller owner reference so that
/// deleting the pipeline garbage-collects it.
pub fn child_meta(dp: &DataPipeline, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: dp.namespace(),
        labels: Some(common_labels(dp)),
        owner_references: owner_reference(dp).map(|o| vec![o]),
        ..ObjectMeta::default()
    }
}

pub fn owner_reference(dp: &DataPipeline) -> Option<OwnerReference> {
    dp.controller_owner_ref(&()).map(|mut o| {
        o.block_owner_deletion = Some(true);
        o
    })
}

/// The loader's path in stoker's one image (`Containerfile`): the image's entrypoint is the
/// operator, so decoder and sidecar containers name the loader.
pub const LOADER_COMMAND: &str = "/usr/local/bin/stoker-loader";

/// The restricted container security context (Pod Security Standard "restricted").
pub fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..SecurityContext::default()
    }
}

/// The pod security context of the operator's loader pods (decoders, index Jobs): the image's
/// nonroot user 65532, RuntimeDefault seccomp.
pub fn loader_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        run_as_group: Some(65532),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..PodSecurityContext::default()
    }
}

pub fn runtime_default_seccomp() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_string(),
        ..SeccompProfile::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::LABEL_DRAINING;
    use k8s_openapi::api::core::v1::Pod;

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    #[test]
    fn only_the_own_image_and_the_allowed_patterns_may_run() {
        let defaults = BuildDefaults {
            allowed_images: vec![
                "registry.example/team-a/*".into(),
                "*.example/x:*-cuda".into(),
            ],
            ..BuildDefaults::default()
        };
        for ok in [
            defaults.loader_image.as_str(),
            "registry.example/team-a/loader:1",
            "registry.example/team-a/",
            "a.example/x:2-cuda",
        ] {
            assert!(defaults.image_allowed(ok), "{ok}");
        }
        for refused in [
            "registry.example/team-b/loader:1",
            "evil/registry.example/team-a/x",
            "a.example/x:2-cuda-not",
            "",
        ] {
            assert!(!defaults.image_allowed(refused), "{refused}");
        }
        assert!(!BuildDefaults::default().image_allowed("registry.example/team-a/loader:1"));
        assert!(glob("*", "anything") && glob("a*a", "aa") && !glob("a*a", "a"));
    }

    #[test]
    fn decoder_pod_carries_the_pipeline_settings() {
        let dp = dp();
        let pod: Pod = decoder_pod::decoder_pod(&dp, &BuildDefaults::default()).expect("builds");
        assert_eq!(
            pod.metadata.generate_name.as_deref(),
            Some("qwen3vl-pretrain-decoder-")
        );
        let labels = pod.metadata.labels.clone().expect("labels");
        assert_eq!(labels[LABEL_ROLE], ROLE_DECODER);
        assert_eq!(labels[LABEL_DRAINING], "false");
        let owner = &pod.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("DataPipeline", Some(true))
        );
        let spec = pod.spec.expect("spec");
        assert_eq!(
            spec.node_selector.expect("selector")["stoker.dev/pool"],
            "cpu"
        );
        assert_eq!(spec.tolerations.expect("tolerations").len(), 1);
        let spread = spec.topology_spread_constraints.expect("spread");
        let keys: Vec<_> = spread.iter().map(|c| c.topology_key.as_str()).collect();
        assert_eq!(
            keys,
            ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
        );
        assert!(
            spread
                .iter()
                .all(|c| c.node_taints_policy.as_deref() == Some("Honor")
                    && c.when_unsatisfiable == "DoNotSchedule"
                    && c.max_skew == 1)
        );
        let c = &spec.containers[0];
        let args = c.args.clone().expect("args").join(" ");
        assert!(
            args.starts_with("decode --grpc-addr 0.0.0.0:50051 --http-addr 0.0.0.0:9090"),
            "{args}"
        );
        let probe = c
            .readiness_probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .expect("probe");
        assert_eq!(probe.path.as_deref(), Some("/readyz"));
        let sc = c.security_context.as_ref().expect("security context");
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let requests = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.clone())
            .expect("requests");
        assert_eq!(requests["cpu"].0, "4");
        assert_eq!(
            c.env_from.as_ref().expect("creds")[0]
                .secret_ref
                .as_ref()
                .expect("secret")
                .name,
            "s3-creds"
        );
    }

    #[test]
    fn template_hash_changes_with_the_spec_only() {
        let a = decoder_pod::decoder_pod(&dp(), &BuildDefaults::default()).expect("builds");
        let b = decoder_pod::decoder_pod(&dp(), &BuildDefaults::default()).expect("builds");
        let mut changed = dp();
        changed.spec.decoders.image = Some("registry.local/loader:2".into());
        let c = decoder_pod::decoder_pod(&changed, &BuildDefaults::default()).expect("builds");
        let hash = |p: &Pod| {
            p.metadata.labels.as_ref().expect("labels")[crate::api::LABEL_TEMPLATE_HASH].clone()
        };
        assert_eq!(hash(&a), hash(&b));
        assert_ne!(hash(&a), hash(&c));
    }

    #[test]
    fn service_selects_only_serving_decoders() {
        let svc = service::decoder_service(&dp());
        let selector = svc.spec.expect("spec").selector.expect("selector");
        assert_eq!(selector[LABEL_DRAINING], "false");
        assert_eq!(selector[LABEL_ROLE], ROLE_DECODER);
        assert_eq!(
            svc.metadata.name.as_deref(),
            Some("qwen3vl-pretrain-decoders")
        );
    }

    #[test]
    fn network_policy_admits_only_the_pipelines_trainers_to_grpc() {
        let np = network_policy::network_policy(&dp());
        let spec = np.spec.expect("spec");
        let grpc = &spec.ingress.as_ref().expect("ingress")[0];
        let from = grpc.from.as_ref().expect("from")[0]
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .expect("labels");
        assert_eq!(from[LABEL_PIPELINE], "qwen3vl-pretrain");
        assert_eq!(from[LABEL_ROLE], crate::api::ROLE_TRAINER);
        assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
    }

    #[test]
    fn sidecar_rbac_reads_pods_and_records_events_only() {
        let role = sidecar_rbac::sidecar_role(&dp());
        let rules = role.rules.expect("rules");
        assert_eq!(rules.len(), 2);
        assert_eq!(rules[0].resources, Some(vec!["pods".to_string()]));
        assert_eq!(rules[0].verbs, ["get", "list", "watch"]);
        assert_eq!(rules[1].api_groups, Some(vec!["events.k8s.io".to_string()]));
        assert_eq!(rules[1].resources, Some(vec!["events".to_string()]));
        assert_eq!(rules[1].verbs, ["create", "patch"]);
        let binding = sidecar_rbac::sidecar_role_binding(&dp());
        assert_eq!(
            binding.subjects.expect("subjects")[0].name,
            "stoker-qwen3vl-pretrain-sidecar"
        );
    }
}
