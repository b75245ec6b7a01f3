//! The webhook's serving certificate, read and written: from files (cert-manager) or
//! self-managed, issued and rotated by [`crate::certs::serving`] and kept here in a Secret and
//! the MutatingWebhookConfiguration's caBundle.

use std::path::PathBuf;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};

pub use crate::certs::serving::{Issued, SelfManaged, TlsSource};
use crate::certs::{CertError, serving};
use crate::installation;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    Issue(#[from] CertError),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("loading the serving certificate into rustls: {0}")]
    Load(std::io::Error),
    #[error("Secret {namespace}/{name}: {source}")]
    Secret {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("Secret {namespace}/{name} stays incomplete after 5 attempts")]
    SecretIncomplete { namespace: String, name: String },
    #[error("MutatingWebhookConfiguration {name}: {source}")]
    WebhookConfiguration { name: String, source: kube::Error },
}

impl TlsError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Issue(_) => "tls_generate",
            Self::Read { .. } | Self::Load(_) => "tls_load",
            Self::Secret { .. } | Self::SecretIncomplete { .. } => "tls_secret",
            Self::WebhookConfiguration { .. } => "tls_ca_bundle",
        }
    }
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
        let Some((secret, issued)) =
            serving::plan(existing.as_ref(), cfg, owner, Timestamp::now())?
        else {
            let Some(current) = existing else { continue };
            if let Some(owner) = owner {
                installation::adopt(&api, &current, owner).await;
            }
            match serving::from_secret(&current) {
                Some(issued) => return Ok(issued),
                None => continue,
            }
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
    Err(TlsError::SecretIncomplete {
        namespace: cfg.secret_namespace.clone(),
        name: cfg.secret_name.clone(),
    })
}

/// Writes the trust bundle into every webhook of the configuration, when it differs. Called
/// before a new certificate serves, so the API server trusts it before it sees it.
pub async fn patch_ca_bundle(
    client: &Client,
    name: &str,
    bundle_pem: &str,
) -> Result<bool, TlsError> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let err = |source| TlsError::WebhookConfiguration {
        name: name.to_string(),
        source,
    };
    for _ in 0..5 {
        let mut cfg = api.get(name).await.map_err(err)?;
        let bundle = ByteString(bundle_pem.as_bytes().to_vec());
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
