//! Certificates for mutual TLS between sidecars and decoders.
//!
//! - One CA per installation, in the operator's namespace: Secret [`CA_SECRET`] (`ca.crt`,
//!   `ca.key`), created when missing, valid [`CA_VALIDITY`] (10 years) and replaced after two
//!   thirds of it; the replaced CA stays trusted (`previous.crt`) so that rotation breaks no
//!   connection.
//! - One certificate per pipeline, in the pipeline's namespace: Secret
//!   `<pipeline>-decoders-tls` (`ca.crt`, `tls.crt`, `tls.key`), owned by the DataPipeline so
//!   that it goes with it. It names the pipeline (its decoder Service's DNS names and
//!   `spiffe://stoker.dev/ns/<namespace>/dp/<name>`), serves as both server and client
//!   certificate, is valid [`LEAF_VALIDITY`] (30 days) and is reissued past two thirds of it
//!   (20 days) or when the CA changed. Decoders and sidecars re-read the mounted files, so a
//!   reissue needs no restart.
//!
//! [`leaf_renewal`] and [`ca_renewal`] decide (pure); [`ensure_pipeline_secret`] reads and writes.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use sha2::{Digest, Sha256};
use stoker_contract::{TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE};

use super::FIELD_MANAGER;
use crate::api::DataPipeline;
use crate::build::decoder_pod::{tls_peer_name, tls_secret_name};
use crate::build::{child_meta, decoder_service_name};
use crate::installation;

/// The installation's CA, in the operator's namespace.
pub const CA_SECRET: &str = "stoker-ca";
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);
pub const LEAF_VALIDITY: Duration = Duration::from_secs(30 * 86_400);
const CA_KEY_FILE: &str = "ca.key";
/// The CA before the last rotation, still trusted until its certificates are reissued.
const CA_PREVIOUS_FILE: &str = "previous.crt";
const ANNOTATION_NOT_BEFORE: &str = "stoker.dev/not-before";
const ANNOTATION_NOT_AFTER: &str = "stoker.dev/not-after";
/// SHA-256 of the trust bundle a pipeline certificate was issued with.
const ANNOTATION_CA: &str = "stoker.dev/ca-sha256";
/// The name a pipeline certificate was issued for.
const ANNOTATION_TLS_NAME: &str = "stoker.dev/tls-name";
/// Clock skew between the operator and the nodes.
const BACKDATE: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("issuing a certificate for {subject}: {source}")]
    Issue {
        subject: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("{verb} Secret {namespace}/{name}: {source}")]
    Secret {
        verb: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
}

impl CertError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Issue { .. } => "certificate_issue",
            Self::Secret { .. } => "certificate_secret",
        }
    }
}

/// Where the installation's CA lives: the operator's namespace (`POD_NAMESPACE`, as the chart
/// sets it), else (an operator run outside a pod, as tests do) the pipeline's own.
pub fn ca_namespace(pipeline_namespace: &str) -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| pipeline_namespace.to_string())
}

/// The CA as loaded from (or written to) its Secret.
#[derive(Clone, Debug, PartialEq)]
pub struct Ca {
    pub cert_pem: String,
    pub key_pem: String,
    /// The replaced CA, still trusted.
    pub previous_pem: Option<String>,
    pub not_before: Timestamp,
    pub not_after: Timestamp,
}

impl Ca {
    /// What peers trust: this CA and the one it replaced.
    pub fn trust_bundle(&self) -> String {
        match &self.previous_pem {
            Some(previous) => format!("{}{}", self.cert_pem, previous),
            None => self.cert_pem.clone(),
        }
    }

    pub fn fingerprint(&self) -> String {
        Sha256::digest(self.trust_bundle().as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// A pipeline's certificate and key.
#[derive(Clone, Debug)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_before: Timestamp,
    pub not_after: Timestamp,
}

fn data_str(secret: &Secret, key: &str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

fn annotation_time(secret: &Secret, key: &str) -> Option<Timestamp> {
    secret.annotations().get(key)?.parse().ok()
}

/// Past two thirds of `[not_before, not_after]` (or outside it).
fn past_two_thirds(not_before: Timestamp, not_after: Timestamp, now: Timestamp) -> bool {
    let life = not_after.duration_since(not_before).as_secs_f64();
    let lived = now.duration_since(not_before).as_secs_f64();
    lived < 0.0 || lived >= life * 2.0 / 3.0
}

fn ca_from_secret(secret: &Secret) -> Option<Ca> {
    Some(Ca {
        cert_pem: data_str(secret, TLS_CA_FILE)?,
        key_pem: data_str(secret, CA_KEY_FILE)?,
        previous_pem: data_str(secret, CA_PREVIOUS_FILE),
        not_before: annotation_time(secret, ANNOTATION_NOT_BEFORE)?,
        not_after: annotation_time(secret, ANNOTATION_NOT_AFTER)?,
    })
}

/// Why the CA must be (re)made now, if it must.
pub fn ca_renewal(existing: Option<&Secret>, now: Timestamp) -> Option<&'static str> {
    let Some(secret) = existing else {
        return Some("missing");
    };
    let Some(ca) = ca_from_secret(secret) else {
        return Some("incomplete");
    };
    past_two_thirds(ca.not_before, ca.not_after, now).then_some("renewal_due")
}

/// Why a pipeline's certificate must be reissued now, if it must: missing or incomplete, issued
/// for another name or under another CA, or past two thirds of its lifetime.
pub fn leaf_renewal(
    existing: Option<&Secret>,
    ca: &Ca,
    tls_name: &str,
    now: Timestamp,
) -> Option<&'static str> {
    let Some(secret) = existing else {
        return Some("missing");
    };
    let complete = [TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE]
        .iter()
        .all(|k| data_str(secret, k).is_some());
    let times = annotation_time(secret, ANNOTATION_NOT_BEFORE)
        .zip(annotation_time(secret, ANNOTATION_NOT_AFTER));
    let Some((not_before, not_after)) = times.filter(|_| complete) else {
        return Some("incomplete");
    };
    let annotations = secret.annotations();
    if annotations.get(ANNOTATION_CA) != Some(&ca.fingerprint()) {
        return Some("ca_changed");
    }
    if annotations.get(ANNOTATION_TLS_NAME).map(String::as_str) != Some(tls_name) {
        return Some("name_changed");
    }
    past_two_thirds(not_before, not_after, now).then_some("renewal_due")
}

fn to_timestamp(t: time::OffsetDateTime) -> Timestamp {
    Timestamp::from_second(t.unix_timestamp()).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn ca_params(not_before: time::OffsetDateTime) -> Result<rcgen::CertificateParams, rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyUsagePurpose};
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    // Only leaves below it: a pipeline's key cannot sign certificates others would trust.
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.distinguished_name
        .push(DnType::CommonName, "stoker-pipeline-ca");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = not_before;
    p.not_after = not_before + CA_VALIDITY;
    Ok(p)
}

/// A new CA valid from now; `previous` (the CA it replaces) stays in the trust bundle.
pub fn new_ca(previous: Option<&Ca>) -> Result<Ca, CertError> {
    let err = |source| CertError::Issue {
        subject: "the pipeline CA".into(),
        source,
    };
    let not_before = time::OffsetDateTime::now_utc() - BACKDATE;
    let params = ca_params(not_before).map_err(err)?;
    let key = rcgen::KeyPair::generate().map_err(err)?;
    let cert = params.self_signed(&key).map_err(err)?;
    Ok(Ca {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        previous_pem: previous.map(|p| p.cert_pem.clone()),
        not_before: to_timestamp(params.not_before),
        not_after: to_timestamp(params.not_after),
    })
}

/// A certificate for `dp` signed by `ca`: DNS names of its decoder Service, its SPIFFE id,
/// server and client use.
pub fn issue_leaf(dp: &DataPipeline, ca: &Ca, validity: Duration) -> Result<Leaf, CertError> {
    use rcgen::{
        CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose,
        SanType,
    };
    let namespace = dp.namespace().unwrap_or_default();
    let name = tls_peer_name(dp);
    let err = |source| CertError::Issue {
        subject: name.clone(),
        source,
    };
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(err)?;
    let ca_not_before = time::OffsetDateTime::from_unix_timestamp(ca.not_before.as_second())
        .map_err(|_| err(rcgen::Error::CouldNotParseCertificate))?;
    let issuer = Issuer::new(ca_params(ca_not_before).map_err(err)?, ca_key);
    let service = decoder_service_name(dp);
    let dns = vec![
        service.clone(),
        format!("{service}.{namespace}"),
        name.clone(),
        format!("{name}.cluster.local"),
    ];
    let mut params = CertificateParams::new(dns).map_err(err)?;
    let spiffe = format!("spiffe://stoker.dev/ns/{namespace}/dp/{}", dp.name_any());
    params
        .subject_alt_names
        .push(SanType::URI(spiffe.try_into().map_err(err)?));
    params.distinguished_name.push(DnType::CommonName, &name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + validity;
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, &issuer).map_err(err)?;
    Ok(Leaf {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_before: to_timestamp(params.not_before),
        not_after: to_timestamp(params.not_after),
    })
}

fn bytes(s: &str) -> ByteString {
    ByteString(s.as_bytes().to_vec())
}

fn times(not_before: Timestamp, not_after: Timestamp) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ANNOTATION_NOT_BEFORE.to_string(), not_before.to_string()),
        (ANNOTATION_NOT_AFTER.to_string(), not_after.to_string()),
    ])
}

fn managed_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(
        "app.kubernetes.io/managed-by".to_string(),
        "stoker-operator".to_string(),
    )])
}

/// The CA from its Secret, made (or replaced) first when needed; the Secret belongs to `owner`
/// (see [`crate::installation`]). Safe against concurrent reconciles: the loser of a create or
/// replace race reads the winner's CA.
pub async fn ensure_ca(
    client: &Client,
    namespace: &str,
    owner: Option<&OwnerReference>,
) -> Result<Ca, CertError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let err = |verb, source| CertError::Secret {
        verb,
        namespace: namespace.to_string(),
        name: CA_SECRET.to_string(),
        source: Box::new(source),
    };
    for _ in 0..5 {
        let existing = api.get_opt(CA_SECRET).await.map_err(|e| err("get", e))?;
        let Some(reason) = ca_renewal(existing.as_ref(), Timestamp::now()) else {
            if let Some(secret) = &existing
                && let Some(ca) = ca_from_secret(secret)
            {
                if let Some(owner) = owner {
                    installation::adopt(&api, secret, owner).await;
                }
                return Ok(ca);
            }
            continue;
        };
        let previous = existing.as_ref().and_then(ca_from_secret);
        let ca = new_ca(previous.as_ref())?;
        let mut data = BTreeMap::from([
            (TLS_CA_FILE.to_string(), bytes(&ca.cert_pem)),
            (CA_KEY_FILE.to_string(), bytes(&ca.key_pem)),
        ]);
        if let Some(p) = &ca.previous_pem {
            data.insert(CA_PREVIOUS_FILE.to_string(), bytes(p));
        }
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(CA_SECRET.to_string()),
                namespace: Some(namespace.to_string()),
                resource_version: existing
                    .as_ref()
                    .and_then(|s| s.metadata.resource_version.clone()),
                annotations: Some(times(ca.not_before, ca.not_after)),
                labels: Some(managed_labels()),
                owner_references: installation::references(owner),
                ..ObjectMeta::default()
            },
            type_: Some("Opaque".to_string()),
            data: Some(data),
            ..Secret::default()
        };
        let written = match existing {
            None => api.create(&PostParams::default(), &secret).await,
            Some(_) => {
                api.replace(CA_SECRET, &PostParams::default(), &secret)
                    .await
            }
        };
        match written {
            Ok(_) => {
                tracing::info!(%namespace, secret = CA_SECRET, reason, not_after = %ca.not_after, "issued the pipeline CA");
                return Ok(ca);
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(err("write", e)),
        }
    }
    let secret = api.get(CA_SECRET).await.map_err(|e| err("get", e))?;
    ca_from_secret(&secret).ok_or_else(|| {
        err(
            "read",
            kube::Error::Service("the CA Secret stays incomplete after 5 attempts".into()),
        )
    })
}

/// The pipeline's Secret as the operator writes it.
pub fn pipeline_secret(dp: &DataPipeline, ca: &Ca, leaf: &Leaf) -> Secret {
    let mut meta = child_meta(dp, tls_secret_name(dp));
    let mut annotations = times(leaf.not_before, leaf.not_after);
    annotations.insert(ANNOTATION_CA.to_string(), ca.fingerprint());
    annotations.insert(ANNOTATION_TLS_NAME.to_string(), tls_peer_name(dp));
    meta.annotations = Some(annotations);
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

/// Makes sure `dp`'s Secret holds a current certificate (under the CA that belongs to
/// `installation`); returns why it was (re)issued, if it was.
pub async fn ensure_pipeline_secret(
    client: &Client,
    dp: &DataPipeline,
    installation: Option<&OwnerReference>,
) -> Result<Option<&'static str>, CertError> {
    let namespace = dp.namespace().unwrap_or_default();
    let ca = ensure_ca(client, &ca_namespace(&namespace), installation).await?;
    let name = tls_secret_name(dp);
    let api: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let err = |verb, source| CertError::Secret {
        verb,
        namespace: namespace.clone(),
        name: name.clone(),
        source: Box::new(source),
    };
    let existing = api.get_opt(&name).await.map_err(|e| err("get", e))?;
    let Some(reason) = leaf_renewal(existing.as_ref(), &ca, &tls_peer_name(dp), Timestamp::now())
    else {
        return Ok(None);
    };
    let leaf = issue_leaf(dp, &ca, LEAF_VALIDITY)?;
    let secret = pipeline_secret(dp, &ca, &leaf);
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&secret),
    )
    .await
    .map_err(|e| err("apply", e))?;
    tracing::info!(%namespace, secret = %name, reason, not_after = %leaf.not_after, "issued the pipeline's certificate");
    Ok(Some(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dp() -> DataPipeline {
        let mut dp: DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        dp.metadata.namespace = Some("training".into());
        dp.metadata.uid = Some("u1".into());
        dp
    }

    #[test]
    fn a_certificate_is_reissued_past_two_thirds_of_its_life_or_under_a_new_ca() {
        let dp = dp();
        let ca = new_ca(None).expect("ca");
        let leaf = issue_leaf(&dp, &ca, LEAF_VALIDITY).expect("leaf");
        let secret = pipeline_secret(&dp, &ca, &leaf);
        let name = tls_peer_name(&dp);
        let at = |days: u64| leaf.not_before + Duration::from_secs(days * 86_400);
        assert_eq!(leaf_renewal(Some(&secret), &ca, &name, at(1)), None);
        assert_eq!(leaf_renewal(Some(&secret), &ca, &name, at(19)), None);
        assert_eq!(
            leaf_renewal(Some(&secret), &ca, &name, at(21)),
            Some("renewal_due"),
            "30-day certificates are reissued after 20 days"
        );
        let other_ca = new_ca(None).expect("ca");
        assert_eq!(
            leaf_renewal(Some(&secret), &other_ca, &name, at(1)),
            Some("ca_changed")
        );
        assert_eq!(
            leaf_renewal(Some(&secret), &ca, "other-decoders.training.svc", at(1)),
            Some("name_changed")
        );
        assert_eq!(leaf_renewal(None, &ca, &name, at(1)), Some("missing"));
        let mut partial = secret.clone();
        partial.data.as_mut().expect("data").remove(TLS_KEY_FILE);
        assert_eq!(
            leaf_renewal(Some(&partial), &ca, &name, at(1)),
            Some("incomplete")
        );
    }

    #[test]
    fn the_ca_is_replaced_past_two_thirds_and_the_old_one_stays_trusted() {
        let ca = new_ca(None).expect("ca");
        let secret = Secret {
            metadata: ObjectMeta {
                annotations: Some(times(ca.not_before, ca.not_after)),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([
                (TLS_CA_FILE.to_string(), bytes(&ca.cert_pem)),
                (CA_KEY_FILE.to_string(), bytes(&ca.key_pem)),
            ])),
            ..Secret::default()
        };
        assert_eq!(ca_renewal(Some(&secret), Timestamp::now()), None);
        let year = Duration::from_secs(365 * 86_400);
        assert_eq!(
            ca_renewal(Some(&secret), ca.not_before + year * 7),
            Some("renewal_due")
        );
        assert_eq!(ca_renewal(None, Timestamp::now()), Some("missing"));
        let next = new_ca(Some(&ca)).expect("next");
        assert!(next.trust_bundle().contains(&ca.cert_pem));
        assert_ne!(next.fingerprint(), ca.fingerprint());
    }
}
