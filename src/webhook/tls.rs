//! Webhook serving certificates: from files (cert-manager) or self-managed (the operator makes a
//! CA and a serving certificate with rcgen, keeps them in a Secret, rotates them before expiry and
//! writes the CA into its MutatingWebhookConfiguration's caBundle).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};

use crate::installation;

const ANNOTATION_NOT_AFTER: &str = "stoker.dev/not-after";
const ANNOTATION_SANS: &str = "stoker.dev/sans";
const CA_KEY: &str = "ca.crt";
const CERT_KEY: &str = "tls.crt";
const KEY_KEY: &str = "tls.key";
const CA_PRIVATE_KEY: &str = "ca.key";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("generating certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing PEM: {0}")]
    Pem(String),
    #[error("loading the serving certificate into rustls: {0}")]
    Load(std::io::Error),
    #[error("Secret {namespace}/{name}: {source}")]
    Secret {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("Secret {namespace}/{name} lacks {key}")]
    SecretIncomplete {
        namespace: String,
        name: String,
        key: &'static str,
    },
    #[error("MutatingWebhookConfiguration {name}: {source}")]
    WebhookConfiguration { name: String, source: kube::Error },
}

impl TlsError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Generate(_) => "tls_generate",
            Self::Read { .. } | Self::Pem(_) | Self::Load(_) => "tls_load",
            Self::Secret { .. } | Self::SecretIncomplete { .. } => "tls_secret",
            Self::WebhookConfiguration { .. } => "tls_ca_bundle",
        }
    }
}

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
    pub ca_pem: String,
    pub ca_key_pem: String,
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

const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);

fn ca_params(now: time::OffsetDateTime) -> Result<rcgen::CertificateParams, TlsError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyUsagePurpose};
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "stoker-webhook-ca");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = now - Duration::from_secs(300);
    p.not_after = now + CA_VALIDITY;
    Ok(p)
}

/// A serving certificate for the given names, valid from now for `validity`, signed by `ca`
/// (PEM certificate and key) when given, else by a new CA. Keeping the CA across renewals means
/// the caBundle the API server trusts stays valid while serving certificates rotate.
pub fn issue(
    dns_names: &[String],
    ips: &[IpAddr],
    validity: Duration,
    ca: Option<(&str, &str)>,
) -> Result<Issued, TlsError> {
    use rcgen::{CertificateParams, DnType, Issuer, KeyPair, SanType};
    let now = time::OffsetDateTime::now_utc();
    let not_after = now + validity;
    let (ca_pem, ca_key_pem, issuer) = match ca {
        Some((ca_pem, ca_key_pem)) => {
            let key = KeyPair::from_pem(ca_key_pem)?;
            let key_pem = key.serialize_pem();
            (
                ca_pem.to_string(),
                key_pem,
                Issuer::new(ca_params(now)?, key),
            )
        }
        None => {
            let key = KeyPair::generate()?;
            let params = ca_params(now)?;
            let cert = params.self_signed(&key)?;
            let key_pem = key.serialize_pem();
            (cert.pem(), key_pem, Issuer::new(params, key))
        }
    };
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    for ip in ips {
        params.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    params.distinguished_name.push(
        DnType::CommonName,
        dns_names.first().map_or("stoker-webhook", String::as_str),
    );
    params.not_before = now - Duration::from_secs(300);
    params.not_after = not_after;
    let cert = params.signed_by(&key, &issuer)?;
    let not_after = Timestamp::from_second(not_after.unix_timestamp())
        .map_err(|e| TlsError::Pem(e.to_string()))?;
    Ok(Issued {
        ca_pem,
        ca_key_pem,
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after,
    })
}

fn secret_data(issued: &Issued) -> BTreeMap<String, ByteString> {
    BTreeMap::from([
        (
            CA_KEY.to_string(),
            ByteString(issued.ca_pem.clone().into_bytes()),
        ),
        (
            CA_PRIVATE_KEY.to_string(),
            ByteString(issued.ca_key_pem.clone().into_bytes()),
        ),
        (
            CERT_KEY.to_string(),
            ByteString(issued.cert_pem.clone().into_bytes()),
        ),
        (
            KEY_KEY.to_string(),
            ByteString(issued.key_pem.clone().into_bytes()),
        ),
    ])
}

fn from_secret(secret: &Secret, cfg: &SelfManaged) -> Result<Issued, TlsError> {
    let get = |key: &'static str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .ok_or_else(|| TlsError::SecretIncomplete {
                namespace: cfg.secret_namespace.clone(),
                name: cfg.secret_name.clone(),
                key,
            })
    };
    let not_after = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_NOT_AFTER))
        .and_then(|s| s.parse::<Timestamp>().ok())
        .ok_or(TlsError::SecretIncomplete {
            namespace: cfg.secret_namespace.clone(),
            name: cfg.secret_name.clone(),
            key: ANNOTATION_NOT_AFTER,
        })?;
    Ok(Issued {
        ca_pem: get(CA_KEY)?,
        ca_key_pem: get(CA_PRIVATE_KEY)?,
        cert_pem: get(CERT_KEY)?,
        key_pem: get(KEY_KEY)?,
        not_after,
    })
}

/// Whether a stored certificate must be replaced: near expiry, or issued for other names.
pub fn needs_renewal(secret: &Secret, cfg: &SelfManaged, now: Timestamp) -> bool {
    let Ok(issued) = from_secret(secret, cfg) else {
        return true;
    };
    let sans = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_SANS));
    let left = issued.not_after.duration_since(now).as_secs_f64();
    sans.map(String::as_str) != Some(&sans_label(&cfg.dns_names, &cfg.ip_addresses))
        || left < cfg.renew_before.as_secs_f64()
}

/// Loads the certificate from the Secret, issuing (or renewing) it first when needed; the Secret
/// belongs to `owner` (see [`crate::installation`]). Safe to run from several replicas at once:
/// writes are guarded by create/resourceVersion conflicts.
pub async fn ensure_secret(
    client: &Client,
    cfg: &SelfManaged,
    owner: Option<&OwnerReference>,
) -> Result<Issued, TlsError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &cfg.secret_namespace);
    let err = |source| TlsError::Secret {
        namespace: cfg.secret_namespace.clone(),
        name: cfg.secret_name.clone(),
        source,
    };
    for _ in 0..5 {
        let existing = api.get_opt(&cfg.secret_name).await.map_err(err)?;
        if let Some(s) = &existing
            && !needs_renewal(s, cfg, Timestamp::now())
        {
            if let Some(owner) = owner {
                installation::adopt(&api, s, owner).await;
            }
            return from_secret(s, cfg);
        }
        let previous = existing.as_ref().and_then(|s| from_secret(s, cfg).ok());
        let ca = previous
            .as_ref()
            .map(|p| (p.ca_pem.as_str(), p.ca_key_pem.as_str()));
        let issued = issue(&cfg.dns_names, &cfg.ip_addresses, cfg.validity, ca)?;
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(cfg.secret_name.clone()),
                namespace: Some(cfg.secret_namespace.clone()),
                resource_version: existing
                    .as_ref()
                    .and_then(|s| s.metadata.resource_version.clone()),
                annotations: Some(BTreeMap::from([
                    (
                        ANNOTATION_NOT_AFTER.to_string(),
                        issued.not_after.to_string(),
                    ),
                    (
                        ANNOTATION_SANS.to_string(),
                        sans_label(&cfg.dns_names, &cfg.ip_addresses),
                    ),
                ])),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "stoker-operator".to_string(),
                )])),
                owner_references: installation::references(owner),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".to_string()),
            data: Some(secret_data(&issued)),
            ..Secret::default()
        };
        let written = match existing {
            None => api.create(&PostParams::default(), &secret).await,
            Some(_) => {
                api.replace(&cfg.secret_name, &PostParams::default(), &secret)
                    .await
            }
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %cfg.secret_name, not_after = %issued.not_after, "issued webhook certificate");
                return Ok(issued);
            }
            // Another replica won the race: use what it wrote.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(err(e)),
        }
    }
    let s = api.get(&cfg.secret_name).await.map_err(err)?;
    from_secret(&s, cfg)
}

/// Writes the CA into every webhook of the configuration, when it differs.
pub async fn patch_ca_bundle(client: &Client, name: &str, ca_pem: &str) -> Result<bool, TlsError> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let err = |source| TlsError::WebhookConfiguration {
        name: name.to_string(),
        source,
    };
    for _ in 0..5 {
        let mut cfg = api.get(name).await.map_err(err)?;
        let bundle = ByteString(ca_pem.as_bytes().to_vec());
        let mut changed = false;
        for w in cfg.webhooks.iter_mut().flatten() {
            if w.client_config.ca_bundle.as_ref() != Some(&bundle) {
                w.client_config.ca_bundle = Some(bundle.clone());
                changed = true;
            }
        }
        if !changed {
            return Ok(false);
        }
        match api.replace(name, &PostParams::default(), &cfg).await {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(err(e)),
        }
    }
    Ok(false)
}

/// Base64 of a PEM, as Helm values and caBundle fields carry it.
pub fn base64_pem(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
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

    fn secret_for(issued: &Issued, c: &SelfManaged) -> Secret {
        Secret {
            metadata: ObjectMeta {
                annotations: Some(BTreeMap::from([
                    (
                        ANNOTATION_NOT_AFTER.to_string(),
                        issued.not_after.to_string(),
                    ),
                    (
                        ANNOTATION_SANS.to_string(),
                        sans_label(&c.dns_names, &c.ip_addresses),
                    ),
                ])),
                ..ObjectMeta::default()
            },
            data: Some(secret_data(issued)),
            ..Secret::default()
        }
    }

    #[tokio::test]
    async fn issued_certificate_loads_into_rustls() {
        let c = cfg();
        let issued = issue(&c.dns_names, &c.ip_addresses, c.validity, None).expect("issue");
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
        let first = issue(&c.dns_names, &c.ip_addresses, c.validity, None).expect("issue");
        let second = issue(
            &c.dns_names,
            &c.ip_addresses,
            c.validity,
            Some((&first.ca_pem, &first.ca_key_pem)),
        )
        .expect("renew");
        assert_eq!(first.ca_pem, second.ca_pem);
        assert_ne!(first.cert_pem, second.cert_pem);
    }

    #[test]
    fn renews_near_expiry_or_for_new_names() {
        let c = cfg();
        let issued = issue(&c.dns_names, &c.ip_addresses, c.validity, None).expect("issue");
        let secret = secret_for(&issued, &c);
        assert!(!needs_renewal(&secret, &c, Timestamp::now()));
        let later = Timestamp::now() + std::time::Duration::from_secs(61 * 86_400);
        assert!(needs_renewal(&secret, &c, later));
        let mut other = cfg();
        other.dns_names.push("stoker-webhook.other.svc".into());
        assert!(needs_renewal(&secret, &other, Timestamp::now()));
        assert!(needs_renewal(&Secret::default(), &c, Timestamp::now()));
    }
}
