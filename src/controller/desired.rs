//! Everything a pipeline should have, as typed values: pure. [`desired`] takes the pipeline,
//! what was observed and what the autoscaler decided, and returns every child; the apply step
//! takes the whole [`Desired`] apart, so a child added here does not compile until it is
//! applied.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use stoker_contract::RenderError;

use super::local_share::{self, LocalShare};
pub use super::observe::Observed;
use super::{Error, fleet};
use crate::api::DataPipeline;
use crate::api::v1alpha1::AutoscalingMode;
use crate::autoscale::ScaleDecision;
use crate::build::{BuildDefaults, decoder_pod, index_job, network_policy, service, sidecar_rbac};
use crate::certs::pipeline::{self as certs, CertChanges};

/// What the decide step concluded for this reconcile.
#[derive(Clone, Debug, Default)]
pub struct Scale {
    /// The autoscaler's decision, when one was due.
    pub decision: Option<ScaleDecision>,
    /// `status.decoders.desired` while an autoscaler runs: it stands between decisions.
    pub in_effect: Option<u32>,
    /// Nodes new decoders keep off (their NIC is past the limit).
    pub avoid_nodes: Vec<String>,
}

/// Every child of a pipeline, and every other write the reconcile makes. A child of a kind
/// the apply step prunes that is not named here is deleted.
#[derive(Clone, Debug)]
pub struct Desired {
    pub service: Service,
    pub network_policy: NetworkPolicy,
    pub sidecar_role: Role,
    pub sidecar_role_binding: RoleBinding,
    /// The sidecar's own identity and its token Secret (see [`sidecar_rbac`]).
    pub sidecar_service_account: ServiceAccount,
    pub sidecar_token: Secret,
    /// The decoders' ServiceAccount, unless the pipeline names its own.
    pub decoder_service_account: Option<ServiceAccount>,
    /// The Job that builds an indexed source's index (see [`index_job`]).
    pub index_job: Option<Job>,
    /// The CA and the pipeline's certificate, when either is (re)issued.
    pub certs: CertChanges,
    /// The trainers to tell a new local-decode share (`auto` mode, on a decision).
    pub local_share: Option<LocalShare>,
    pub decoders: DecoderChanges,
}

/// The fleet's size and this reconcile's changes to its pods.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecoderChanges {
    /// Decoders the pipeline should run.
    pub replicas: u32,
    /// Why that many, for `status.lastScale`.
    pub reason: String,
    /// New decoder pods (the API server names them).
    pub create: Vec<Pod>,
    /// Serving decoders to take out of discovery.
    pub drain: Vec<String>,
    /// Pods to delete: drained long enough, or failed.
    pub delete: Vec<String>,
    /// Of `delete`, the failed ones (they are replaced).
    pub failed: usize,
    /// When to look again for a drain that is still running.
    pub requeue_after: Option<Duration>,
}

impl DecoderChanges {
    pub fn any(&self) -> bool {
        !self.create.is_empty() || !self.drain.is_empty() || !self.delete.is_empty()
    }
}

/// Why the desired state could not be built.
#[derive(Debug, thiserror::Error)]
pub enum DesiredError {
    #[error("loader arguments for DataPipeline {name}: {source}")]
    LoaderArgs {
        name: String,
        #[source]
        source: RenderError,
    },
    #[error(transparent)]
    Certificates(#[from] crate::certs::CertError),
}

impl From<DesiredError> for Error {
    fn from(e: DesiredError) -> Self {
        match e {
            DesiredError::LoaderArgs { name, source } => Error::LoaderArgs { name, source },
            DesiredError::Certificates(e) => Error::Certificates(e),
        }
    }
}

/// Every child `dp` should have now; `installation` owns the CA.
pub fn desired(
    dp: &DataPipeline,
    observed: &Observed,
    scale: &Scale,
    defaults: &BuildDefaults,
    installation: Option<&OwnerReference>,
    now: Timestamp,
) -> Result<Desired, DesiredError> {
    let loader_args = |source| DesiredError::LoaderArgs {
        name: dp.name_any(),
        source,
    };
    Ok(Desired {
        service: service::decoder_service(dp),
        network_policy: network_policy::network_policy(dp),
        sidecar_role: sidecar_rbac::sidecar_role(dp),
        sidecar_role_binding: sidecar_rbac::sidecar_role_binding(dp),
        sidecar_service_account: sidecar_rbac::sidecar_service_account(dp),
        sidecar_token: sidecar_rbac::sidecar_token_secret(dp),
        decoder_service_account: sidecar_rbac::decoder_service_account_object(dp),
        index_job: index_job::index_job(dp, defaults).map_err(loader_args)?,
        certs: certs::plan(dp, &observed.certs, installation, now)?,
        local_share: local_share_told(dp, observed, scale),
        decoders: decoder_changes(dp, observed, scale, defaults, now).map_err(loader_args)?,
    })
}

/// In `auto` mode a decision's local-decode share goes to the trainers that say otherwise; in
/// `recommend` mode the decision is recorded, never acted on.
fn local_share_told(dp: &DataPipeline, observed: &Observed, scale: &Scale) -> Option<LocalShare> {
    let decision = scale.decision.as_ref()?;
    if dp.spec.autoscaling.mode != AutoscalingMode::Auto {
        return None;
    }
    local_share::plan(&observed.trainers, decision.local_decode_share)
}

/// The decoder count, and the pods to create, drain and delete to reach it. Decoders whose
/// node's NIC is past the limit drain and are replaced elsewhere.
fn decoder_changes(
    dp: &DataPipeline,
    observed: &Observed,
    scale: &Scale,
    defaults: &BuildDefaults,
    now: Timestamp,
) -> Result<DecoderChanges, RenderError> {
    let count = crate::autoscale::decoder_count(&dp.spec, scale.decision.as_ref(), scale.in_effect);
    let template = decoder_pod::decoder_pod(dp, defaults)?;
    let hash = template
        .spec
        .as_ref()
        .map(decoder_pod::template_hash)
        .unwrap_or_default();
    let drain_seconds = u32::try_from(dp.spec.decoders.drain_seconds).unwrap_or(0);
    let mut plan = fleet::plan(
        &observed.decoders,
        count.replicas as usize,
        &hash,
        drain_seconds,
        now,
    );
    for pod in scale.decision.iter().flat_map(|d| &d.move_pods) {
        if !plan.drain.contains(pod) && !plan.delete.contains(pod) {
            plan.drain.push(pod.clone());
            plan.create += 1;
        }
    }
    let mut new_pod = template;
    crate::autoscale::keep_off(&mut new_pod, &scale.avoid_nodes);
    Ok(DecoderChanges {
        replicas: count.replicas,
        reason: count.reason,
        create: vec![new_pod; plan.create],
        drain: plan.drain,
        delete: plan.delete,
        failed: plan.failed,
        requeue_after: plan.requeue_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{LABEL_DRAINING, LABEL_TEMPLATE_HASH};

    fn dp(fixture: &str) -> DataPipeline {
        serde_yaml::from_str(fixture).expect("fixture")
    }

    fn crop() -> DataPipeline {
        dp(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("valid")
    }

    /// A serving decoder of `dp` built from its current spec, on `node`.
    fn serving(dp: &DataPipeline, name: &str, node: &str) -> Pod {
        let mut pod = decoder_pod::decoder_pod(dp, &BuildDefaults::default()).expect("builds");
        pod.metadata.name = Some(name.into());
        pod.spec.as_mut().expect("spec").node_name = Some(node.into());
        pod.status = serde_json::from_value(serde_json::json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        }))
        .expect("status");
        pod
    }

    #[test]
    fn a_new_pipeline_gets_min_replicas_decoders_and_every_child() {
        let dp = crop();
        let d = desired(
            &dp,
            &Observed::default(),
            &Scale::default(),
            &BuildDefaults::default(),
            None,
            t(0),
        )
        .expect("builds");
        assert_eq!(d.decoders.replicas, 4, "{}", d.decoders.reason);
        assert_eq!(d.decoders.create.len(), 4);
        assert!(
            d.certs.ca.is_some() && d.certs.pipeline.is_some(),
            "a first pipeline brings the CA and its certificate"
        );
        let labels = d.decoders.create[0]
            .metadata
            .labels
            .clone()
            .expect("labels");
        assert_eq!(labels[LABEL_DRAINING], "false");
        assert!(labels.contains_key(LABEL_TEMPLATE_HASH));
        assert_eq!(
            d.service.metadata.name.as_deref(),
            Some("qwen3vl-pretrain-decoders")
        );
        assert_eq!(
            d.network_policy.metadata.name.as_deref(),
            Some("qwen3vl-pretrain-decoders")
        );
        assert_eq!(
            d.sidecar_role_binding.role_ref.name,
            d.sidecar_role.metadata.name.clone().expect("name")
        );
    }

    #[test]
    fn a_fixed_pipeline_scales_to_its_replicas() {
        let dp = dp(include_str!("../../tests/fixtures/datapipeline-qwen.yaml"));
        let observed = Observed {
            decoders: (0..5)
                .map(|i| serving(&dp, &format!("d{i}"), &format!("n{i}")))
                .collect(),
            ..Observed::default()
        };
        let d = desired(
            &dp,
            &observed,
            &Scale::default(),
            &BuildDefaults::default(),
            None,
            t(0),
        )
        .expect("builds");
        assert_eq!(d.decoders.replicas, 3);
        assert!(d.decoders.create.is_empty());
        assert_eq!(d.decoders.drain.len(), 2);
    }

    #[test]
    fn the_autoscalers_decision_moves_and_places_decoders() {
        let dp = crop();
        let observed = Observed {
            decoders: (0..4)
                .map(|i| serving(&dp, &format!("d{i}"), &format!("n{i}")))
                .collect(),
            ..Observed::default()
        };
        // A decision without signals keeps the size; the test adds the move.
        let policy = crate::autoscale::AutoscalingPolicy::from_spec(&dp.spec);
        let fleet = crate::autoscale::DecoderFleet {
            replicas: 4,
            ..crate::autoscale::DecoderFleet::default()
        };
        let mut decision = crate::autoscale::Autoscaler::default().step(
            &crate::api::PipelineKey::new("training", "p"),
            &policy,
            &fleet,
            None,
            t(0),
        );
        decision.move_pods = vec!["d1".into()];
        let scale = Scale {
            decision: Some(decision),
            in_effect: Some(4),
            avoid_nodes: vec!["n1".into()],
        };
        let d = desired(
            &dp,
            &observed,
            &scale,
            &BuildDefaults::default(),
            None,
            t(0),
        )
        .expect("builds");
        assert_eq!(d.decoders.drain, vec!["d1".to_string()]);
        assert_eq!(d.decoders.create.len(), 1, "the moved decoder is replaced");
        let affinity = serde_json::to_value(&d.decoders.create[0].spec).expect("json");
        assert!(
            affinity.to_string().contains(r#""values":["n1"]"#),
            "{affinity}"
        );
    }

    #[test]
    fn between_decisions_the_count_in_effect_stands() {
        let dp = crop();
        let scale = Scale {
            in_effect: Some(9),
            ..Scale::default()
        };
        let d = desired(
            &dp,
            &Observed::default(),
            &scale,
            &BuildDefaults::default(),
            None,
            t(0),
        )
        .expect("builds");
        assert_eq!(d.decoders.replicas, 9);
        assert_eq!(d.decoders.create.len(), 9);
    }
}
