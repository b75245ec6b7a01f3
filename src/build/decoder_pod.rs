//! One decoder pod. The operator owns decoders individually (no Deployment) so that a scale change
//! never restarts a healthy decoder and scale-down can choose which pods go.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar, HTTPGetAction, Pod,
    PodSpec, Probe, ResourceRequirements, SecretEnvSource, SecretVolumeSource,
    TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube_quantity::ParsedQuantity;
use sha2::{Digest, Sha256};

use super::{BuildDefaults, child_meta, decoder_selector_labels, restricted_security_context};
use crate::api::{DataPipeline, LABEL_DRAINING, LABEL_ROLE, LABEL_TEMPLATE_HASH, ROLE_DECODER};
use stoker_contract::{
    DECODER_GRPC_PORT, DECODER_METRICS_PORT, RenderError, ResizeMode, TLS_DIR, TlsArgs,
};

pub const DECODER_CONTAINER: &str = "decoder";
const HOSTNAME_KEY: &str = "kubernetes.io/hostname";
const ZONE_KEY: &str = "topology.kubernetes.io/zone";

/// Turns off the AWS SDK's instance-metadata (IMDS) credentials and region: without it, a
/// pipeline with no credentials Secret would read S3 as the node's instance role. Web identity
/// (IRSA, workload identity) does not use IMDS and keeps working.
pub const IMDS_DISABLED_ENV: &str = "AWS_EC2_METADATA_DISABLED";

/// The pod volume of the pipeline's TLS Secret, in decoders and trainer pods.
pub const TLS_VOLUME: &str = "stoker-tls";

/// The Secret holding the pipeline's certificate, key and the installation's CA, which the
/// operator issues and rotates (`controller::certs`).
pub fn tls_secret_name(dp: &DataPipeline) -> String {
    format!("{}-tls", super::decoder_service_name(dp))
}

/// The name the pipeline's certificate carries and decoders and sidecars require of each other.
pub fn tls_peer_name(dp: &DataPipeline) -> String {
    stoker_contract::pipeline_tls_name(
        &super::decoder_service_name(dp),
        &dp.namespace().unwrap_or_default(),
    )
}

/// The loader's TLS flags for `dp`: its Secret's mount and its name.
pub fn tls_args(dp: &DataPipeline) -> TlsArgs {
    TlsArgs {
        tls_dir: Some(TLS_DIR.into()),
        tls_peer_name: Some(tls_peer_name(dp)),
    }
}

/// The Secret as a volume; a pod waits for it rather than start without mutual TLS.
pub fn tls_volume(dp: &DataPipeline) -> Volume {
    Volume {
        name: TLS_VOLUME.to_string(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(tls_secret_name(dp)),
            optional: Some(false),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

pub fn tls_mount() -> VolumeMount {
    VolumeMount {
        name: TLS_VOLUME.to_string(),
        mount_path: TLS_DIR.to_string(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

fn default_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity("1".to_string())),
            ("memory".to_string(), Quantity("1Gi".to_string())),
        ])),
        ..ResourceRequirements::default()
    }
}

/// The decoder's resources: the pipeline's, else 1 CPU and 1Gi requested; with no memory limit
/// set, the decoder's memory bound ([`stoker_contract::DecodeArgs::memory_bound`]: its threads
/// decoding their largest sample, its admitted batches, its requests in flight) becomes the
/// limit, so that a decoder past its own design is OOM-killed rather than its node's neighbours.
fn decoder_resources(dp: &DataPipeline) -> Result<ResourceRequirements, RenderError> {
    let mut resources = dp
        .spec
        .decoders
        .resources
        .clone()
        .unwrap_or_else(default_resources);
    let has_memory_limit = resources
        .limits
        .as_ref()
        .is_some_and(|l| l.contains_key("memory"));
    if !has_memory_limit {
        let requested = resources
            .requests
            .as_ref()
            .and_then(|r| r.get("memory"))
            .and_then(|q| quantity_value(&q.0))
            .map_or(0, |b| b.ceil() as u64);
        let limit = decoder_memory_bound(dp)?.max(requested);
        resources.limits.get_or_insert_with(BTreeMap::new).insert(
            "memory".to_string(),
            Quantity(format!("{}Mi", limit.div_ceil(1 << 20))),
        );
    }
    Ok(resources)
}

/// The memory a decoder of `dp` needs at most, from the flags it runs with and the batches its
/// sidecars send.
pub fn decoder_memory_bound(dp: &DataPipeline) -> Result<u64, RenderError> {
    let decode = super::loader_args::decode(dp).map_err(RenderError::Parse)?;
    let sidecar = super::loader_args::sidecar(dp).map_err(RenderError::Parse)?;
    let t = &sidecar.transform;
    let output_pixels = match t.resize {
        ResizeMode::QwenSmart => t.max_pixels,
        ResizeMode::Crop | ResizeMode::Fit => u64::from(t.width) * u64::from(t.height),
    };
    Ok(decode.memory_bound(decode.threads, sidecar.batch_size as u64, output_pixels))
}

/// A quantity's value (CPUs, bytes); through f64 so that "1.5" and "500m" keep their fraction.
fn quantity_value(q: &str) -> Option<f64> {
    let v = ParsedQuantity::try_from(q).ok()?.to_bytes_f64()?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// The decoder's CPUs, rounded up: its CPU limit, else its request. Its decode threads: a
/// decoder with no limit would otherwise start one thread per node core, and its memory bound
/// would depend on the node it lands on.
pub fn decoder_cpus(dp: &DataPipeline) -> usize {
    let resources = dp
        .spec
        .decoders
        .resources
        .clone()
        .unwrap_or_else(default_resources);
    let cpu = |list: Option<&BTreeMap<String, Quantity>>| {
        list.and_then(|l| l.get("cpu"))
            .and_then(|q| quantity_value(&q.0))
    };
    cpu(resources.limits.as_ref())
        .or_else(|| cpu(resources.requests.as_ref()))
        .map_or(1, |c| (c.ceil() as usize).max(1))
}

/// S3 credentials, as environment, for decoders and sidecars.
/// `AWS_EC2_METADATA_DISABLED=true` unless the pipeline sets `source.s3.useInstanceMetadata`.
pub fn instance_metadata_env(dp: &DataPipeline) -> Option<EnvVar> {
    (!dp.spec.source.s3.use_instance_metadata).then(|| EnvVar {
        name: IMDS_DISABLED_ENV.to_string(),
        value: Some("true".to_string()),
        ..EnvVar::default()
    })
}

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
        command: Some(vec![super::LOADER_COMMAND.to_string()]),
        args: Some(super::loader_args::decoder_args(dp)?),
        // Decoders have no ServiceAccount token (no IRSA): they read S3 with the pipeline's
        // Secret, or with the node's role only when the pipeline opts in.
        env: Some(
            std::iter::once(EnvVar {
                name: stoker_contract::env::PIPELINE.to_string(),
                value: Some(name.clone()),
                ..EnvVar::default()
            })
            .chain(instance_metadata_env(dp))
            .collect(),
        ),
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
        resources: Some(decoder_resources(dp)?),
        security_context: Some(restricted_security_context()),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "tmp".to_string(),
                mount_path: "/tmp".to_string(),
                ..VolumeMount::default()
            },
            tls_mount(),
        ]),
        ..Container::default()
    };
    Ok(PodSpec {
        containers: vec![container],
        node_selector: (!d.node_selector.is_empty()).then(|| d.node_selector.clone()),
        tolerations: (!d.tolerations.is_empty()).then(|| d.tolerations.clone()),
        topology_spread_constraints: Some(spread),
        // `decoders.serviceAccountName` (IRSA, workload identity) or the pipeline's decoder
        // account with no permissions; either way no API token: decoders never call the API.
        service_account_name: Some(super::sidecar_rbac::decoder_service_account(dp)),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        restart_policy: Some("Always".to_string()),
        termination_grace_period_seconds: Some(30),
        security_context: Some(super::loader_pod_security()),
        volumes: Some(vec![
            Volume {
                name: "tmp".to_string(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            },
            tls_volume(dp),
        ]),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    fn memory_limit(dp: &DataPipeline) -> Option<String> {
        let spec = decoder_pod_spec(dp, &BuildDefaults::default()).expect("builds");
        spec.containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"))
            .map(|q| q.0.clone())
    }

    /// The fixture's decoders request 4 CPUs and no memory limit: 4 threads decoding 64 Mpx at
    /// 16 bytes (4 GiB), 10 admitted batches of 32 x (2 MiB + 448² x 3), 20 requests of 4 MiB,
    /// 128 MiB for the process.
    #[test]
    fn the_default_memory_limit_is_the_decoders_bound() {
        let dp = dp();
        assert_eq!(decoder_cpus(&dp), 4);
        let batch = 32 * ((2 << 20) + 448 * 448 * 3);
        let bound = 4 * (64 << 20) * 16 + 10 * batch + 20 * (4 << 20) + (128 << 20);
        assert_eq!(decoder_memory_bound(&dp).expect("bound"), bound);
        assert_eq!(
            memory_limit(&dp),
            Some(format!("{}Mi", bound.div_ceil(1 << 20)))
        );
    }

    #[test]
    fn a_memory_limit_the_pipeline_sets_stands() {
        let mut dp = dp();
        let r = dp
            .spec
            .decoders
            .resources
            .get_or_insert_with(Default::default);
        r.limits = Some(BTreeMap::from([
            ("memory".to_string(), Quantity("3Gi".into())),
            ("cpu".to_string(), Quantity("1500m".into())),
        ]));
        assert_eq!(memory_limit(&dp).as_deref(), Some("3Gi"));
        assert_eq!(decoder_cpus(&dp), 2, "the CPU limit, rounded up");
    }

    #[test]
    fn the_limit_is_never_below_the_request() {
        let mut dp = dp();
        let r = dp
            .spec
            .decoders
            .resources
            .get_or_insert_with(Default::default);
        r.requests = Some(BTreeMap::from([
            ("memory".to_string(), Quantity("64Gi".into())),
            ("cpu".to_string(), Quantity("1".into())),
        ]));
        assert_eq!(memory_limit(&dp).as_deref(), Some("65536Mi"));
    }

    #[test]
    fn defaults_give_one_thread_and_its_bound() {
        let mut dp = dp();
        dp.spec.decoders.resources = None;
        assert_eq!(decoder_cpus(&dp), 1);
        let bound = decoder_memory_bound(&dp).expect("bound");
        assert_eq!(
            memory_limit(&dp),
            Some(format!("{}Mi", bound.div_ceil(1 << 20)))
        );
    }

    #[test]
    fn decoders_use_instance_metadata_only_when_the_pipeline_asks() {
        let imds_off = |dp: &DataPipeline| {
            let spec = decoder_pod_spec(dp, &BuildDefaults::default()).expect("builds");
            let env = spec.containers[0].env.clone().expect("env");
            env.iter()
                .any(|e| e.name == IMDS_DISABLED_ENV && e.value.as_deref() == Some("true"))
        };
        let mut without_secret = dp();
        without_secret.spec.source.s3.credentials_secret_ref = None;
        assert!(imds_off(&dp()));
        assert!(imds_off(&without_secret));
        let mut opted_in = without_secret;
        opted_in.spec.source.s3.use_instance_metadata = true;
        assert!(!imds_off(&opted_in));
    }
}
