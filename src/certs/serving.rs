//! The webhook's serving certificate, when the operator issues its own (the other source is
//! files, e.g. from cert-manager): a CA and a serving certificate kept together in one Secret,
//! the certificate renewed [`SelfManaged::renew_before`] its expiry or when the names change,
//! the CA rotated as every stoker CA is (see [`super`]): the caBundle the API server trusts is
//! the CA's trust bundle, so it holds the new CA before the new certificate serves.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use stoker_contract::{TLS_CERT_FILE, TLS_KEY_FILE};

use super::{
    Authority, Ca, CaAnnotations, CertError, LeafRequest, annotation_time, bytes, ca_from_secret,
    ca_secret_parts, current_or_new_ca, data_str, issue_leaf, managed_labels,
};
use crate::installation;

const AUTHORITY: Authority = Authority {
    common_name: "stoker-webhook-ca",
};
/// The serving certificate's expiry.
pub const ANNOTATION_NOT_AFTER: &str = "stoker.dev/not-after";
const ANNOTATION_SANS: &str = "stoker.dev/sans";
const CA_TIMES: CaAnnotations = CaAnnotations {
    not_before: "stoker.dev/ca-not-before",
    not_after: "stoker.dev/ca-not-after",
};

/// Where the webhook's serving certificate comes from.
#[derive(Clone, Debug)]
pub enum TlsSource {
    /// PEM files, e.g. a cert-manager Secret mounted into the pod; re-read periodically.
    Files { cert: PathBuf, key: PathBuf },
    /// The operator issues and rotates its own certificate.
    SelfManaged(SelfManaged),
}

#[derive(Clone, Debug)]
pub struct SelfManaged {
    pub secret_namespace: String,
    pub secret_name: String,
    pub dns_names: Vec<String>,
    pub ip_addresses: Vec<IpAddr>,
    /// The MutatingWebhookConfiguration whose caBundle the operator keeps current.
    pub webhook_configuration: String,
    /// Validity of each serving certificate.
    pub validity: Duration,
    /// Renew when less than this is left.
    pub renew_before: Duration,
}

/// PEM material of one issued serving certificate.
#[derive(Clone, Debug, PartialEq)]
pub struct Issued {
    /// The CA that signed `cert_pem`.
    pub ca_pem: String,
    /// What the API server must trust: the CA and the one it replaced.
    pub trust_bundle: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: Timestamp,
}

fn sans_label(dns: &[String], ips: &[IpAddr]) -> String {
    let mut all: Vec<String> = dns.to_vec();
    all.extend(ips.iter().map(ToString::to_string));
    all.sort();
    all.join(",")
}

/// The CA a serving Secret holds. One written before its CA carried a validity (every
/// version up to 0.3) yields its CA as already due: it is rotated, and stays trusted.
fn stored_ca(secret: &Secret) -> Option<Ca> {
    ca_from_secret(secret, CA_TIMES).or_else(|| {
        let unknown = Timestamp::UNIX_EPOCH;
        Some(Ca {
            cert_pem: data_str(secret, stoker_contract::TLS_CA_FILE)?,
            key_pem: data_str(secret, "ca.key")?,
            previous_pem: None,
            not_before: unknown,
            not_after: unknown,
        })
    })
}

/// What a serving Secret holds, if it is whole.
pub fn from_secret(secret: &Secret) -> Option<Issued> {
    let ca = ca_from_secret(secret, CA_TIMES)?;
    Some(Issued {
        trust_bundle: ca.trust_bundle(),
        ca_pem: ca.cert_pem,
        cert_pem: data_str(secret, TLS_CERT_FILE)?,
        key_pem: data_str(secret, TLS_KEY_FILE)?,
        not_after: annotation_time(secret, ANNOTATION_NOT_AFTER)?,
    })
}

/// Why a stored certificate must be replaced now, if it must: incomplete, issued for other
/// names, near expiry, or its CA due.
pub fn renewal(secret: &Secret, cfg: &SelfManaged, now: Timestamp) -> Option<&'static str> {
    let Some(issued) = from_secret(secret) else {
        return Some("incomplete");
    };
    let sans = secret
        .annotations()
        .get(ANNOTATION_SANS)
        .map(String::as_str);
    if sans != Some(&sans_label(&cfg.dns_names, &cfg.ip_addresses)) {
        return Some("names_changed");
    }
    if issued.not_after.duration_since(now).as_secs_f64() < cfg.renew_before.as_secs_f64() {
        return Some("renewal_due");
    }
    stored_ca(secret).and_then(|ca| ca.renewal(now))
}

/// The Secret to write in place of `existing` (its resourceVersion the precondition) so that
/// it holds a current certificate, with what it holds; `None` when `existing` is current.
pub fn plan(
    existing: Option<&Secret>,
    cfg: &SelfManaged,
    owner: Option<&OwnerReference>,
    now: Timestamp,
) -> Result<Option<(Secret, Issued)>, CertError> {
    if let Some(s) = existing
        && renewal(s, cfg, now).is_none()
    {
        return Ok(None);
    }
    let (ca, _) = current_or_new_ca(AUTHORITY, existing.and_then(stored_ca), now)?;
    let request = LeafRequest {
        common_name: cfg
            .dns_names
            .first()
            .map_or("stoker-webhook", String::as_str)
            .to_string(),
        dns_names: cfg.dns_names.clone(),
        ip_addresses: cfg.ip_addresses.clone(),
        validity: cfg.validity,
        ..LeafRequest::default()
    };
    let leaf = issue_leaf(AUTHORITY, &ca, &request)?;
    let (mut data, mut annotations) = ca_secret_parts(&ca, CA_TIMES);
    data.insert(TLS_CERT_FILE.to_string(), bytes(&leaf.cert_pem));
    data.insert(TLS_KEY_FILE.to_string(), bytes(&leaf.key_pem));
    annotations.extend([
        (ANNOTATION_NOT_AFTER.to_string(), leaf.not_after.to_string()),
        (
            ANNOTATION_SANS.to_string(),
            sans_label(&cfg.dns_names, &cfg.ip_addresses),
        ),
    ]);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(cfg.secret_name.clone()),
            namespace: Some(cfg.secret_namespace.clone()),
            resource_version: existing.and_then(|s| s.metadata.resource_version.clone()),
            annotations: Some(annotations),
            labels: Some(managed_labels()),
            owner_references: installation::references(owner),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(data),
        ..Secret::default()
    };
    let issued = Issued {
        trust_bundle: ca.trust_bundle(),
        ca_pem: ca.cert_pem,
        cert_pem: leaf.cert_pem,
        key_pem: leaf.key_pem,
        not_after: leaf.not_after,
    };
    Ok(Some((secret, issued)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SelfManaged {
        SelfManaged {
            secret_namespace: "stoker-system".into(),
            secret_name: "tls".into(),
            dns_names: vec!["stoker-webhook.stoker-system.svc".into()],
            ip_addresses: vec!["127.0.0.1".parse().expect("ip")],
            webhook_configuration: "x".into(),
            validity: Duration::from_secs(90 * 86_400),
            renew_before: Duration::from_secs(30 * 86_400),
        }
    }

    fn first(c: &SelfManaged) -> (Secret, Issued) {
        plan(None, c, None, Timestamp::now())
            .expect("plan")
            .expect("a new Secret")
    }

    #[tokio::test]
    async fn issued_certificate_loads_into_rustls() {
        let (_, issued) = first(&cfg());
        axum_server::tls_rustls::RustlsConfig::from_pem(
            issued.cert_pem.clone().into_bytes(),
            issued.key_pem.clone().into_bytes(),
        )
        .await
        .expect("loads");
        assert!(issued.ca_pem.contains("BEGIN CERTIFICATE"));
    }

    #[test]
    fn renewal_keeps_the_ca() {
        let c = cfg();
        let (secret, issued) = first(&c);
        let later = Timestamp::now() + Duration::from_secs(61 * 86_400);
        let (_, renewed) = plan(Some(&secret), &c, None, later)
            .expect("plan")
            .expect("renewed");
        assert_eq!(issued.ca_pem, renewed.ca_pem);
        assert_ne!(issued.cert_pem, renewed.cert_pem);
    }

    #[test]
    fn renews_near_expiry_or_for_new_names() {
        let c = cfg();
        let (secret, _) = first(&c);
        assert_eq!(renewal(&secret, &c, Timestamp::now()), None);
        let later = Timestamp::now() + Duration::from_secs(61 * 86_400);
        assert_eq!(renewal(&secret, &c, later), Some("renewal_due"));
        let mut other = cfg();
        other.dns_names.push("stoker-webhook.other.svc".into());
        assert_eq!(
            renewal(&secret, &other, Timestamp::now()),
            Some("names_changed")
        );
        assert_eq!(
            renewal(&Secret::default(), &c, Timestamp::now()),
            Some("incomplete")
        );
    }

    #[test]
    fn a_due_ca_rotates_with_the_old_one_in_the_bundle() {
        let mut c = cfg();
        c.renew_before = Duration::ZERO;
        let (secret, issued) = first(&c);
        let seven_years = Timestamp::now() + Duration::from_secs(7 * 365 * 86_400);
        c.validity = Duration::from_secs(8 * 365 * 86_400);
        let (_, rotated) = plan(Some(&secret), &c, None, seven_years)
            .expect("plan")
            .expect("rotated");
        assert_ne!(rotated.ca_pem, issued.ca_pem);
        assert!(rotated.trust_bundle.starts_with(&rotated.ca_pem));
        assert!(rotated.trust_bundle.contains(&issued.ca_pem));
    }

    #[test]
    fn a_secret_from_before_ca_validity_rotates_its_ca_and_keeps_trusting_it() {
        let c = cfg();
        let (mut secret, issued) = first(&c);
        let annotations = secret.metadata.annotations.as_mut().expect("annotations");
        annotations.retain(|k, _| !k.starts_with("stoker.dev/ca-"));
        assert_eq!(renewal(&secret, &c, Timestamp::now()), Some("incomplete"));
        let (_, rotated) = plan(Some(&secret), &c, None, Timestamp::now())
            .expect("plan")
            .expect("rotated");
        assert_ne!(rotated.ca_pem, issued.ca_pem);
        assert!(rotated.trust_bundle.contains(&issued.ca_pem));
    }

    #[test]
    fn the_secret_reads_back_as_what_was_issued() {
        let (secret, issued) = first(&cfg());
        assert_eq!(from_secret(&secret), Some(issued));
    }
}
