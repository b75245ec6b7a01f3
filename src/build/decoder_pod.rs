//! One decoder pod. The operator owns decoders individually (no Deployment) so that a scale change
//! never restarts a healthy decoder and scale-down can choose which pods go.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar, HTTPGetAction, Pod,
    PodSecurityContext, PodSpec, Probe, ResourceRequirements, SecretEnvSource,
    TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use super::{
    BuildDefaults, child_meta, decoder_selector_labels, restricted_security_context,
    runtime_default_seccomp,
};
use crate::api::{DataPipeline, LABEL_DRAINING, LABEL_ROLE, LABEL_TEMPLATE_HASH, ROLE_DECODER};
use stoker_contract::{DECODER_GRPC_PORT, DECODER_METRICS_PORT, RenderError};

pub const DECODER_CONTAINER: &str = "decoder";
const HOSTNAME_KEY: &str = "kubernetes.io/hostname";
const ZONE_KEY: &str = "topology.kubernetes.io/zone";

fn default_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity("1".to_string())),
            ("memory".to_string(), Quantity("1Gi".to_string())),
        ])),
        ..ResourceRequirements::default()
    }
}

/// S3 credentials, as environment, for decoders and sidecars.
pub fn credentials_env_from(dp: &DataPipeline) -> Option<Vec<EnvFromSource>> {
    dp.spec.source.s3.credentials_secret_ref.as_ref().map(|s| {
        vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: s.name.clone(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        }]
    })
}

fn spread_constraint(pipeline: &str, key: &str, max_skew: i32) -> TopologySpreadConstraint {
    TopologySpreadConstraint {
        topology_key: key.to_string(),
        max_skew,
        when_unsatisfiable: "DoNotSchedule".to_string(),
        label_selector: Some(LabelSelector {
            match_labels: Some(decoder_selector_labels(pipeline)),
            ..LabelSelector::default()
        }),
        // Count only nodes decoders may land on: those matching the node selector and whose
        // taints the decoders tolerate (GPU nodes would otherwise hold the skew at zero).
        node_affinity_policy: Some("Honor".to_string()),
        node_taints_policy: Some("Honor".to_string()),
        ..TopologySpreadConstraint::default()
    }
}

/// The pod spec every decoder of the pipeline shares (names and hash excluded).
pub fn decoder_pod_spec(
    dp: &DataPipeline,
    defaults: &BuildDefaults,
) -> Result<PodSpec, RenderError> {
    let name = dp.name_any();
    let d = &dp.spec.decoders;
    let mut spread = vec![spread_constraint(&name, HOSTNAME_KEY, d.spread.max_skew)];
    if d.spread.zones {
        spread.push(spread_constraint(&name, ZONE_KEY, d.spread.max_skew));
    }
    let container = Container {
        name: DECODER_CONTAINER.to_string(),
        image: Some(defaults.loader_image(dp)),
        args: Some(super::loader_args::decoder_args(dp)?),
        env: Some(vec![EnvVar {
            name: stoker_contract::env::PIPELINE.to_string(),
            value: Some(name.clone()),
            ..EnvVar::default()
        }]),
        env_from: credentials_env_from(dp),
        ports: Some(vec![
            ContainerPort {
                name: Some("grpc".to_string()),
                container_port: i32::from(DECODER_GRPC_PORT),
                protocol: Some("TCP".to_string()),
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("metrics".to_string()),
                container_port: i32::from(DECODER_METRICS_PORT),
                protocol: Some("TCP".to_string()),
                ..ContainerPort::default()
            },
        ]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".to_string()),
                port: IntOrString::String("metrics".to_string()),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(5),
            failure_threshold: Some(2),
            ..Probe::default()
        }),
        resources: Some(d.resources.clone().unwrap_or_else(default_resources)),
        security_context: Some(restricted_security_context()),
        volume_mounts: Some(vec![VolumeMount {
            name: "tmp".to_string(),
            mount_path: "/tmp".to_string(),
            ..VolumeMount::default()
        }]),
        ..Container::default()
    };
    Ok(PodSpec {
        containers: vec![container],
        node_selector: (!d.node_selector.is_empty()).then(|| d.node_selector.clone()),
        tolerations: (!d.tolerations.is_empty()).then(|| d.tolerations.clone()),
        topology_spread_constraints: Some(spread),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        restart_policy: Some("Always".to_string()),
        termination_grace_period_seconds: Some(30),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            seccomp_profile: Some(runtime_default_seccomp()),
            ..PodSecurityContext::default()
        }),
        volumes: Some(vec![Volume {
            name: "tmp".to_string(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        }]),
        ..PodSpec::default()
    })
}

/// Short hash of the shared pod spec: tells which decoders were built from an older spec.
pub fn template_hash(spec: &PodSpec) -> String {
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    digest[..5].iter().map(|b| format!("{b:02x}")).collect()
}

/// A decoder pod; the API server names it `<pipeline>-decoder-<random suffix>`.
pub fn decoder_pod(dp: &DataPipeline, defaults: &BuildDefaults) -> Result<Pod, RenderError> {
    let spec = decoder_pod_spec(dp, defaults)?;
    let mut meta = child_meta(dp, String::new());
    meta.name = None;
    meta.generate_name = Some(format!("{}-decoder-", dp.name_any()));
    let labels = meta.labels.get_or_insert_with(BTreeMap::new);
    labels.insert(LABEL_ROLE.to_string(), ROLE_DECODER.to_string());
    labels.insert(LABEL_DRAINING.to_string(), "false".to_string());
    labels.insert(LABEL_TEMPLATE_HASH.to_string(), template_hash(&spec));
    labels.insert(
        "app.kubernetes.io/name".to_string(),
        "stoker-decoder".to_string(),
    );
    Ok(Pod {
        metadata: meta,
        spec: Some(spec),
        status: None,
    })
}
