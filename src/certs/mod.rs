//! Every certificate stoker issues, and when each is renewed. Pure: rcgen and Secret values,
//! no API calls (the controller's observe and apply steps and the webhook's keeper read and
//! write the Secrets).
//!
//! Two authorities, one implementation ([`Ca`], [`issue_leaf`], [`past_two_thirds`]):
//! - the pipeline CA ([`pipeline`]): mutual TLS between sidecars and decoders;
//! - the webhook CA ([`serving`]): the API server's calls to the admission webhook.
//!
//! Rotation is the same for both, and bundle-first: a CA is replaced past two thirds of its
//! [`CA_VALIDITY`]; the new CA's trust bundle keeps the replaced one (`previous.crt`), and that
//! bundle is what peers (decoders, sidecars, the API server) are given before and while
//! certificates signed by the new CA appear. A certificate signed by either verifies
//! throughout, so a rotation breaks no connection.

pub mod pipeline;
pub mod serving;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use sha2::{Digest, Sha256};
use stoker_contract::TLS_CA_FILE;

pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);
const CA_KEY_FILE: &str = "ca.key";
/// The CA before the last rotation, still trusted until its certificates are reissued.
const CA_PREVIOUS_FILE: &str = "previous.crt";
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
}

impl CertError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Issue { .. } => "certificate_issue",
        }
    }
}

/// What a CA is for: its common name and how deep below it certificates may chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Authority {
    pub common_name: &'static str,
}

/// A CA as loaded from (or written to) its Secret.
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

    /// SHA-256 of the trust bundle: what a certificate records it was issued under.
    pub fn fingerprint(&self) -> String {
        Sha256::digest(self.trust_bundle().as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Why this CA must be replaced now, if it must.
    pub fn renewal(&self, now: Timestamp) -> Option<&'static str> {
        past_two_thirds(self.not_before, self.not_after, now).then_some("renewal_due")
    }
}

/// Where a Secret keeps a CA's validity (annotations) next to its files.
#[derive(Clone, Copy, Debug)]
pub struct CaAnnotations {
    pub not_before: &'static str,
    pub not_after: &'static str,
}

/// A certificate and its key.
#[derive(Clone, Debug)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_before: Timestamp,
    pub not_after: Timestamp,
}

/// What a leaf certificate names and may do.
#[derive(Clone, Debug, Default)]
pub struct LeafRequest {
    pub common_name: String,
    pub dns_names: Vec<String>,
    pub ip_addresses: Vec<IpAddr>,
    pub uris: Vec<String>,
    /// Also a client certificate (mutual TLS), not only a server's.
    pub client: bool,
    pub validity: Duration,
}

/// Past two thirds of `[not_before, not_after]` (or outside it).
pub fn past_two_thirds(not_before: Timestamp, not_after: Timestamp, now: Timestamp) -> bool {
    let life = not_after.duration_since(not_before).as_secs_f64();
    let lived = now.duration_since(not_before).as_secs_f64();
    lived < 0.0 || lived >= life * 2.0 / 3.0
}

fn to_timestamp(t: time::OffsetDateTime) -> Timestamp {
    Timestamp::from_second(t.unix_timestamp()).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn ca_params(
    authority: Authority,
    not_before: time::OffsetDateTime,
) -> Result<rcgen::CertificateParams, rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyUsagePurpose};
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    // Only leaves below it: a leaf's key cannot sign certificates others would trust.
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.distinguished_name
        .push(DnType::CommonName, authority.common_name);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = not_before;
    p.not_after = not_before + CA_VALIDITY;
    Ok(p)
}

/// A new CA valid from now; `previous` (the CA it replaces) stays in its trust bundle.
pub fn new_ca(authority: Authority, previous: Option<&Ca>) -> Result<Ca, CertError> {
    let err = |source| CertError::Issue {
        subject: authority.common_name.into(),
        source,
    };
    let not_before = time::OffsetDateTime::now_utc() - BACKDATE;
    let params = ca_params(authority, not_before).map_err(err)?;
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

/// A certificate for `request`, signed by `ca`.
pub fn issue_leaf(authority: Authority, ca: &Ca, request: &LeafRequest) -> Result<Leaf, CertError> {
    use rcgen::{
        CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose,
        SanType,
    };
    let err = |source| CertError::Issue {
        subject: request.common_name.clone(),
        source,
    };
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(err)?;
    let ca_not_before = time::OffsetDateTime::from_unix_timestamp(ca.not_before.as_second())
        .map_err(|_| err(rcgen::Error::CouldNotParseCertificate))?;
    let issuer = Issuer::new(ca_params(authority, ca_not_before).map_err(err)?, ca_key);
    let mut params = CertificateParams::new(request.dns_names.clone()).map_err(err)?;
    for ip in &request.ip_addresses {
        params.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    for uri in &request.uris {
        let uri = uri.clone().try_into().map_err(err)?;
        params.subject_alt_names.push(SanType::URI(uri));
    }
    params
        .distinguished_name
        .push(DnType::CommonName, &request.common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    if request.client {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ClientAuth);
    }
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + request.validity;
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, &issuer).map_err(err)?;
    Ok(Leaf {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_before: to_timestamp(params.not_before),
        not_after: to_timestamp(params.not_after),
    })
}

/// The CA `existing` holds, or a new one (with `existing`'s as its previous) when it holds
/// none or its CA is due; and why it was replaced, if it was.
pub fn current_or_new_ca(
    authority: Authority,
    existing: Option<Ca>,
    now: Timestamp,
) -> Result<(Ca, Option<&'static str>), CertError> {
    let reason = match &existing {
        None => Some("missing"),
        Some(ca) => ca.renewal(now),
    };
    match (existing, reason) {
        (Some(ca), None) => Ok((ca, None)),
        (previous, reason) => Ok((new_ca(authority, previous.as_ref())?, reason)),
    }
}

fn data_str(secret: &Secret, key: &str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

fn annotation_time(secret: &Secret, key: &str) -> Option<Timestamp> {
    secret.annotations().get(key)?.parse().ok()
}

fn bytes(s: &str) -> ByteString {
    ByteString(s.as_bytes().to_vec())
}

/// The CA a Secret holds (`ca.crt`, `ca.key`, `previous.crt`, its validity in `at`), if whole.
pub fn ca_from_secret(secret: &Secret, at: CaAnnotations) -> Option<Ca> {
    Some(Ca {
        cert_pem: data_str(secret, TLS_CA_FILE)?,
        key_pem: data_str(secret, CA_KEY_FILE)?,
        previous_pem: data_str(secret, CA_PREVIOUS_FILE),
        not_before: annotation_time(secret, at.not_before)?,
        not_after: annotation_time(secret, at.not_after)?,
    })
}

/// The files and annotations that hold `ca` in a Secret (see [`ca_from_secret`]).
pub fn ca_secret_parts(
    ca: &Ca,
    at: CaAnnotations,
) -> (BTreeMap<String, ByteString>, BTreeMap<String, String>) {
    let mut data = BTreeMap::from([
        (TLS_CA_FILE.to_string(), bytes(&ca.cert_pem)),
        (CA_KEY_FILE.to_string(), bytes(&ca.key_pem)),
    ]);
    if let Some(p) = &ca.previous_pem {
        data.insert(CA_PREVIOUS_FILE.to_string(), bytes(p));
    }
    let annotations = BTreeMap::from([
        (at.not_before.to_string(), ca.not_before.to_string()),
        (at.not_after.to_string(), ca.not_after.to_string()),
    ]);
    (data, annotations)
}

fn managed_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(
        "app.kubernetes.io/managed-by".to_string(),
        "stoker-operator".to_string(),
    )])
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST: Authority = Authority {
        common_name: "test-ca",
    };
    const AT: CaAnnotations = CaAnnotations {
        not_before: "a/nb",
        not_after: "a/na",
    };

    #[test]
    fn a_ca_is_replaced_past_two_thirds_and_the_old_one_stays_trusted() {
        let (ca, reason) = current_or_new_ca(TEST, None, Timestamp::now()).expect("ca");
        assert_eq!(reason, Some("missing"));
        let (kept, reason) = current_or_new_ca(TEST, Some(ca.clone()), Timestamp::now()).expect("");
        assert_eq!((kept == ca, reason), (true, None));
        let seven_years = ca.not_before + Duration::from_secs(7 * 365 * 86_400);
        let (next, reason) = current_or_new_ca(TEST, Some(ca.clone()), seven_years).expect("");
        assert_eq!(reason, Some("renewal_due"));
        assert!(next.trust_bundle().starts_with(&next.cert_pem));
        assert!(next.trust_bundle().contains(&ca.cert_pem), "bundle-first");
        assert_ne!(next.fingerprint(), ca.fingerprint());
    }

    #[test]
    fn a_ca_reads_back_from_the_secret_it_is_written_to() {
        let ca = new_ca(TEST, Some(&new_ca(TEST, None).expect("old"))).expect("ca");
        let (data, annotations) = ca_secret_parts(&ca, AT);
        let mut secret = Secret {
            data: Some(data),
            ..Secret::default()
        };
        secret.metadata.annotations = Some(annotations);
        assert_eq!(ca_from_secret(&secret, AT), Some(ca));
        secret.data.as_mut().expect("data").remove(CA_KEY_FILE);
        assert_eq!(
            ca_from_secret(&secret, AT),
            None,
            "an incomplete CA is none"
        );
    }

    #[test]
    fn a_leaf_signed_by_the_ca_names_what_was_asked() {
        let ca = new_ca(TEST, None).expect("ca");
        let request = LeafRequest {
            common_name: "svc.ns".into(),
            dns_names: vec!["svc.ns".into()],
            ip_addresses: vec!["127.0.0.1".parse().expect("ip")],
            uris: vec!["spiffe://stoker.dev/ns/ns/dp/p".into()],
            client: true,
            validity: Duration::from_secs(86_400),
        };
        let leaf = issue_leaf(TEST, &ca, &request).expect("leaf");
        assert!(leaf.cert_pem.contains("BEGIN CERTIFICATE"));
        let life = leaf.not_after.duration_since(leaf.not_before).as_secs();
        assert_eq!(life.unsigned_abs(), 86_400 + BACKDATE.as_secs());
    }
}
