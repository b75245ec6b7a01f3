//! Certificates for mutual TLS between sidecars and decoders.
//!
//! - One CA per installation, in the operator's namespace: Secret [`CA_SECRET`] (`ca.crt`,
//!   `ca.key`, `previous.crt`), rotated as every stoker CA is (see [`super`]).
//! - One certificate per pipeline, in the pipeline's namespace: Secret
//!   `<pipeline>-decoders-tls` (`ca.crt` = the trust bundle, `tls.crt`, `tls.key`), owned by
//!   the DataPipeline so that it goes with it. It names the pipeline (its decoder Service's DNS
//!   names and `spiffe://stoker.dev/ns/<namespace>/dp/<name>`), serves as both server and client
//!   certificate, is valid [`LEAF_VALIDITY`] (30 days) and is reissued past two thirds of it
//!   (20 days) or when the CA changed. Decoders and sidecars re-read the mounted files, so a
//!   reissue needs no restart.
//!
//! [`plan`] decides both from what the reconcile observed: the CA Secret (read under the
//! operator's own Role) and, for the pipeline's Secret, only whether it exists and the
//! certificate the pipeline's `status.certificate` records; the operator never reads a Secret
//! in a pipeline's namespace.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use stoker_contract::{TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE};

use super::{
    Authority, Ca, CaAnnotations, CertError, Leaf, LeafRequest, bytes, ca_from_secret,
    ca_secret_parts, current_or_new_ca, issue_leaf, managed_labels, past_two_thirds,
};
use crate::api::DataPipeline;
use crate::api::v1alpha1::CertificateStatus;
use crate::build::decoder_pod::{tls_peer_name, tls_secret_name};
use crate::build::{child_meta, decoder_service_name};
use crate::installation;

/// The installation's CA, in the operator's namespace.
pub const CA_SECRET: &str = "stoker-ca";
pub const LEAF_VALIDITY: Duration = Duration::from_secs(30 * 86_400);
const AUTHORITY: Authority = Authority {
    common_name: "stoker-pipeline-ca",
};
const ANNOTATION_NOT_BEFORE: &str = "stoker.dev/not-before";
const ANNOTATION_NOT_AFTER: &str = "stoker.dev/not-after";
/// The CA Secret keeps its CA's validity where a pipeline Secret keeps its certificate's.
const CA_TIMES: CaAnnotations = CaAnnotations {
    not_before: ANNOTATION_NOT_BEFORE,
    not_after: ANNOTATION_NOT_AFTER,
};
/// SHA-256 of the trust bundle a pipeline certificate was issued with.
const ANNOTATION_CA: &str = "stoker.dev/ca-sha256";
/// The name a pipeline certificate was issued for.
const ANNOTATION_TLS_NAME: &str = "stoker.dev/tls-name";

/// Where the installation's CA lives: the operator's namespace (`POD_NAMESPACE`, as the chart
/// sets it), else (an operator run outside a pod, as tests do) the pipeline's own.
pub fn ca_namespace(pipeline_namespace: &str) -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| pipeline_namespace.to_string())
}

/// What the observe step knows of a pipeline's certificates.
#[derive(Clone, Debug, Default)]
pub struct CertSecrets {
    /// The installation's CA ([`CA_SECRET`] in [`ca_namespace`]).
    pub ca: Option<Secret>,
    /// Whether the pipeline's own Secret ([`tls_secret_name`]) exists (a dry-run create says).
    pub pipeline_exists: bool,
    /// The certificate the operator last wrote there, as the pipeline's status records it.
    pub issued: Option<CertificateStatus>,
}

/// What to write so that the pipeline has a current certificate. The CA goes first: a
/// certificate must never reach the decoders before the CA that signed it is stored.
#[derive(Clone, Debug, Default)]
pub struct CertChanges {
    /// A new or adopted CA Secret, with the resourceVersion it replaces (a conflict means
    /// another reconcile wrote it first: this one's certificate is discarded and retried).
    pub ca: Option<Secret>,
    /// The pipeline's Secret, when its certificate is (re)issued.
    pub pipeline: Option<Secret>,
    /// What `status.certificate` records once that Secret is written.
    pub record: Option<CertificateStatus>,
    /// Why the certificate is (re)issued, if it is.
    pub reason: Option<&'static str>,
}

/// The certificate changes `dp` needs, from the Secrets observed. `installation` owns the CA.
pub fn plan(
    dp: &DataPipeline,
    observed: &CertSecrets,
    installation: Option<&OwnerReference>,
    now: Timestamp,
) -> Result<CertChanges, CertError> {
    let stored = observed
        .ca
        .as_ref()
        .and_then(|s| ca_from_secret(s, CA_TIMES));
    let (ca, ca_reason) = current_or_new_ca(AUTHORITY, stored, now)?;
    let namespace = ca_namespace(&dp.namespace().unwrap_or_default());
    let ca_secret = match (ca_reason, observed.ca.as_ref()) {
        (Some(_), existing) => Some(ca_secret(&namespace, &ca, existing, installation)),
        (None, Some(existing)) => installation
            .filter(|owner| installation::lacks(existing, owner))
            .map(|_| ca_secret(&namespace, &ca, Some(existing), installation)),
        (None, None) => None,
    };
    let reason = ca_reason
        .map(|_| "ca_changed")
        .or_else(|| leaf_renewal(observed, &ca, &tls_peer_name(dp), now));
    let (pipeline, record) = match reason {
        Some(_) => {
            let leaf = issue(dp, &ca)?;
            (
                Some(pipeline_secret(dp, &ca, &leaf)),
                Some(record(dp, &ca, &leaf)),
            )
        }
        None => (None, None),
    };
    Ok(CertChanges {
        ca: ca_secret,
        pipeline,
        record,
        reason,
    })
}

/// The CA Secret holding `ca`, replacing `existing` (its resourceVersion the precondition).
fn ca_secret(
    namespace: &str,
    ca: &Ca,
    existing: Option<&Secret>,
    owner: Option<&OwnerReference>,
) -> Secret {
    let (data, annotations) = ca_secret_parts(ca, CA_TIMES);
    Secret {
        metadata: ObjectMeta {
            name: Some(CA_SECRET.to_string()),
            namespace: Some(namespace.to_string()),
            resource_version: existing.and_then(|s| s.metadata.resource_version.clone()),
            annotations: Some(annotations),
            labels: Some(managed_labels()),
            owner_references: installation::references(owner),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_string()),
        data: Some(data),
        ..Secret::default()
    }
}

/// Why a pipeline's certificate must be reissued now, if it must: its Secret missing, no
/// record of what it holds (a status lost, or a pipeline from before records), issued for
/// another name or under another CA, or past two thirds of its lifetime.
pub fn leaf_renewal(
    observed: &CertSecrets,
    ca: &Ca,
    tls_name: &str,
    now: Timestamp,
) -> Option<&'static str> {
    if !observed.pipeline_exists {
        return Some("missing");
    }
    let Some(issued) = &observed.issued else {
        return Some("unrecorded");
    };
    if issued.ca_sha256 != ca.fingerprint() {
        return Some("ca_changed");
    }
    if issued.name != tls_name {
        return Some("name_changed");
    }
    past_two_thirds(issued.not_before.0, issued.not_after.0, now).then_some("renewal_due")
}

/// What `status.certificate` says of `leaf`.
fn record(dp: &DataPipeline, ca: &Ca, leaf: &Leaf) -> CertificateStatus {
    CertificateStatus {
        not_before: Time(leaf.not_before),
        not_after: Time(leaf.not_after),
        ca_sha256: ca.fingerprint(),
        name: tls_peer_name(dp),
    }
}

/// A certificate for `dp` signed by `ca`: DNS names of its decoder Service, its SPIFFE id,
/// server and client use.
fn issue(dp: &DataPipeline, ca: &Ca) -> Result<Leaf, CertError> {
    let namespace = dp.namespace().unwrap_or_default();
    let name = tls_peer_name(dp);
    let service = decoder_service_name(dp);
    let request = LeafRequest {
        dns_names: vec![
            service.clone(),
            format!("{service}.{namespace}"),
            name.clone(),
            format!("{name}.cluster.local"),
        ],
        uris: vec![format!(
            "spiffe://stoker.dev/ns/{namespace}/dp/{}",
            dp.name_any()
        )],
        common_name: name,
        client: true,
        validity: LEAF_VALIDITY,
        ..LeafRequest::default()
    };
    issue_leaf(AUTHORITY, ca, &request)
}

/// The pipeline's Secret as the operator writes it.
fn pipeline_secret(dp: &DataPipeline, ca: &Ca, leaf: &Leaf) -> Secret {
    let mut meta = child_meta(dp, tls_secret_name(dp));
    meta.annotations = Some(BTreeMap::from([
        (
            ANNOTATION_NOT_BEFORE.to_string(),
            leaf.not_before.to_string(),
        ),
        (ANNOTATION_NOT_AFTER.to_string(), leaf.not_after.to_string()),
        (ANNOTATION_CA.to_string(), ca.fingerprint()),
        (ANNOTATION_TLS_NAME.to_string(), tls_peer_name(dp)),
    ]));
    Secret {
        metadata: meta,
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(BTreeMap::from([
            (TLS_CA_FILE.to_string(), bytes(&ca.trust_bundle())),
            (TLS_CERT_FILE.to_string(), bytes(&leaf.cert_pem)),
            (TLS_KEY_FILE.to_string(), bytes(&leaf.key_pem)),
        ])),
        ..Secret::default()
    }
}

#[cfg(test)]
mod tests {
    use super::super::data_str;
    use super::*;

    fn dp() -> DataPipeline {
        let mut dp: DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        dp.metadata.namespace = Some("training".into());
        dp.metadata.uid = Some("u1".into());
        dp
    }

    fn owner(uid: &str) -> OwnerReference {
        OwnerReference {
            uid: uid.into(),
            name: "stoker".into(),
            kind: "ClusterRole".into(),
            api_version: "rbac.authorization.k8s.io/v1".into(),
            ..OwnerReference::default()
        }
    }

    /// What the API server would hold after `changes` were written over `observed`.
    fn written(observed: &CertSecrets, changes: &CertChanges) -> CertSecrets {
        CertSecrets {
            ca: changes.ca.clone().or_else(|| observed.ca.clone()),
            pipeline_exists: observed.pipeline_exists || changes.pipeline.is_some(),
            issued: changes.record.clone().or_else(|| observed.issued.clone()),
        }
    }

    #[test]
    fn a_new_installation_writes_its_ca_before_the_certificate_it_signs() {
        let dp = dp();
        let first = plan(&dp, &CertSecrets::default(), None, Timestamp::now()).expect("plan");
        let (ca, pipeline) = (first.ca.clone().expect("ca"), first.pipeline.clone());
        assert_eq!(ca.metadata.name.as_deref(), Some(CA_SECRET));
        assert_eq!(first.reason, Some("ca_changed"));
        let stored = ca_from_secret(&ca, CA_TIMES).expect("whole CA");
        let bundle = data_str(&pipeline.expect("leaf"), TLS_CA_FILE).expect("bundle");
        assert_eq!(bundle, stored.trust_bundle());
        let settled = written(&CertSecrets::default(), &first);
        let again = plan(&dp, &settled, None, Timestamp::now()).expect("plan");
        assert!(again.ca.is_none() && again.pipeline.is_none(), "{again:?}");
    }

    #[test]
    fn a_certificate_is_reissued_past_two_thirds_of_its_life_or_under_a_new_ca() {
        let dp = dp();
        let now = Timestamp::now();
        let settled = written(
            &CertSecrets::default(),
            &plan(&dp, &CertSecrets::default(), None, now).expect("plan"),
        );
        let ca = ca_from_secret(settled.ca.as_ref().expect("ca"), CA_TIMES).expect("ca");
        let name = tls_peer_name(&dp);
        let at = |days: u64| now + Duration::from_secs(days * 86_400);
        assert_eq!(leaf_renewal(&settled, &ca, &name, at(19)), None);
        assert_eq!(
            leaf_renewal(&settled, &ca, &name, at(21)),
            Some("renewal_due"),
            "30-day certificates are reissued after 20 days"
        );
        let other = super::super::new_ca(AUTHORITY, None).expect("ca");
        assert_eq!(
            leaf_renewal(&settled, &other, &name, at(1)),
            Some("ca_changed")
        );
        assert_eq!(
            leaf_renewal(&settled, &ca, "other-decoders.training.svc", at(1)),
            Some("name_changed")
        );
        let deleted = CertSecrets {
            pipeline_exists: false,
            ..settled.clone()
        };
        assert_eq!(leaf_renewal(&deleted, &ca, &name, at(1)), Some("missing"));
        let lost_status = CertSecrets {
            issued: None,
            ..settled.clone()
        };
        assert_eq!(
            leaf_renewal(&lost_status, &ca, &name, at(1)),
            Some("unrecorded")
        );
    }

    #[test]
    fn the_record_in_status_is_what_was_issued_and_holds_no_key() {
        let dp = dp();
        let now = Timestamp::now();
        let first = plan(&dp, &CertSecrets::default(), None, now).expect("plan");
        let record = first
            .record
            .clone()
            .expect("a record of the new certificate");
        let secret = first.pipeline.expect("secret");
        let annotations = secret.annotations();
        assert_eq!(annotations[ANNOTATION_CA], record.ca_sha256);
        assert_eq!(
            annotations[ANNOTATION_NOT_AFTER],
            record.not_after.0.to_string()
        );
        assert_eq!(record.name, tls_peer_name(&dp));
        let json = serde_json::to_string(&record).expect("json");
        assert!(
            !json.contains("PRIVATE KEY") && !json.contains("CERTIFICATE"),
            "{json}"
        );
    }

    #[test]
    fn a_due_ca_is_replaced_and_every_certificate_reissued_trusting_both() {
        let dp = dp();
        let now = Timestamp::now();
        let mut settled = written(
            &CertSecrets::default(),
            &plan(&dp, &CertSecrets::default(), None, now).expect("plan"),
        );
        settled.ca.as_mut().expect("ca").metadata.resource_version = Some("7".into());
        let old = ca_from_secret(settled.ca.as_ref().expect("ca"), CA_TIMES).expect("ca");
        let later = now + Duration::from_secs(7 * 365 * 86_400);
        let rotated = plan(&dp, &settled, None, later).expect("plan");
        let new_secret = rotated.ca.expect("a new CA");
        assert_eq!(new_secret.metadata.resource_version.as_deref(), Some("7"));
        let new = ca_from_secret(&new_secret, CA_TIMES).expect("ca");
        assert_eq!(new.previous_pem.as_deref(), Some(old.cert_pem.as_str()));
        let bundle = data_str(&rotated.pipeline.expect("reissued"), TLS_CA_FILE).expect("ca");
        assert!(bundle.contains(&old.cert_pem) && bundle.contains(&new.cert_pem));
    }

    #[test]
    fn an_installation_adopts_a_ca_it_does_not_own_yet() {
        let dp = dp();
        let now = Timestamp::now();
        let settled = written(
            &CertSecrets::default(),
            &plan(&dp, &CertSecrets::default(), None, now).expect("plan"),
        );
        let adopted = plan(&dp, &settled, Some(&owner("i1")), now).expect("plan");
        let ca = adopted.ca.expect("adopted");
        assert_eq!(
            ca.metadata.owner_references.as_ref().expect("owner")[0].uid,
            "i1"
        );
        assert_eq!(
            ca_from_secret(&ca, CA_TIMES),
            ca_from_secret(settled.ca.as_ref().expect("ca"), CA_TIMES),
            "adoption keeps the CA"
        );
        assert!(adopted.pipeline.is_none(), "nor reissues the certificate");
    }
}
