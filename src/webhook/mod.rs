//! The mutating admission webhook: a thin HTTPS adapter around [`inject`].

pub mod inject;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::{Client, ResourceExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{DataPipeline, LABEL_PIPELINE};
use crate::telemetry::Metrics;
use inject::{InjectConfig, injection_patch};
use tls::{CertStore, TlsSource};

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

impl WebhookError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Bind { .. } => "webhook_bind",
            Self::Tls(e) => e.category(),
        }
    }
}

/// How the webhook is served.
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    pub listen: SocketAddr,
    pub tls: TlsSource,
    /// How often the certificate is re-read (files) or checked for renewal (self-managed).
    pub refresh_interval: Duration,
    pub inject: InjectConfig,
}

#[derive(Clone)]
struct Handler {
    client: Client,
    inject: InjectConfig,
    metrics: Arc<Metrics>,
}

impl Handler {
    /// Admission decision for one pod: refuse a pod that names a missing pipeline, else patch.
    async fn admit(&self, req: &AdmissionRequest<Pod>) -> AdmissionResponse {
        let allow = AdmissionResponse::from(req);
        if !matches!(req.operation, Operation::Create) {
            return allow;
        }
        let Some(pod) = req.object.as_ref() else {
            return allow;
        };
        let Some(pipeline) = pod.labels().get(LABEL_PIPELINE).cloned() else {
            return allow;
        };
        let namespace = req
            .namespace
            .clone()
            .or_else(|| pod.namespace())
            .unwrap_or_default();
        let api: Api<DataPipeline> = Api::namespaced(self.client.clone(), &namespace);
        match api.get_opt(&pipeline).await {
            Ok(Some(dp)) => match injection_patch(pod, &dp, &self.inject) {
                Ok(patch) if patch.0.is_empty() => allow,
                Ok(patch) => match allow.clone().with_patch(patch) {
                    Ok(r) => {
                        self.metrics.webhook("injected");
                        r
                    }
                    Err(e) => allow.deny(format!("stoker could not encode the sidecar patch: {e}")),
                },
                Err(e) => {
                    self.metrics.webhook(e.category());
                    allow.deny(format!("stoker could not inject the loader sidecar: {e}"))
                }
            },
            Ok(None) => {
                self.metrics.webhook("pipeline_missing");
                allow.deny(format!(
                    "DataPipeline \"{pipeline}\" (named by the pod label {LABEL_PIPELINE}) does not exist in namespace \"{namespace}\": create it first, or fix or remove the label"
                ))
            }
            Err(e) => {
                self.metrics.webhook("kube_api");
                allow.deny(format!(
                    "stoker could not read DataPipeline \"{pipeline}\": {e}"
                ))
            }
        }
    }
}

async fn mutate(
    State(handler): State<Handler>,
    Json(review): Json<AdmissionReview<Pod>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let response = match TryInto::<AdmissionRequest<Pod>>::try_into(review) {
        Ok(req) => handler.admit(&req).await,
        Err(e) => AdmissionResponse::invalid(e.to_string()),
    };
    Json(response.into_review())
}

/// The webhook server, bound and running.
pub struct WebhookServer {
    pub local_addr: SocketAddr,
    pub task: tokio::task::JoinHandle<()>,
}

/// The injection webhook's configuration for an operator reached by `url` from outside the
/// cluster (a local run, a test), limited to the namespace `namespace`. In a cluster the
/// chart's `templates/webhook.yaml` is the one, with the same rules and selectors.
pub fn url_configuration(name: &str, namespace: &str, url: &str) -> MutatingWebhookConfiguration {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "inject.stoker.dev",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "timeoutSeconds": 10,
            "clientConfig": {"url": url},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "objectSelector": {"matchExpressions": [
                {"key": LABEL_PIPELINE, "operator": "Exists"},
                {"key": crate::api::LABEL_ROLE, "operator": "NotIn", "values": [crate::api::ROLE_DECODER]}
            ]}
        }]
    }))
    .expect("a literal MutatingWebhookConfiguration deserializes")
}

/// Loads (or issues) the certificate, binds, and serves until `shutdown`.
pub async fn serve(
    client: Client,
    config: WebhookConfig,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<WebhookServer, WebhookError> {
    let store = CertStore::new(load_certificate(&client, &config.tls).await?);
    let tls_config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(tls::TlsError::from)?
    .with_no_client_auth()
    .with_cert_resolver(store.clone());
    let mut tls_config = tls_config;
    tls_config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls_config));

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| WebhookError::Bind {
            addr: config.listen,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| WebhookError::Bind {
        addr: config.listen,
        source,
    })?;
    let app = Router::new()
        .route("/mutate", post(mutate))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Handler {
            client: client.clone(),
            inject: config.inject.clone(),
            metrics,
        });

    tokio::spawn(refresh_certificate(
        client,
        config.clone(),
        store,
        shutdown.clone(),
    ));
    let task = tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                a = listener.accept() => a,
            };
            let Ok((stream, _)) = accepted else { continue };
            let acceptor = acceptor.clone();
            let app = app.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let service = TowerToHyperService::new(app);
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    tracing::info!(%local_addr, "webhook listening");
    Ok(WebhookServer { local_addr, task })
}

async fn load_certificate(
    client: &Client,
    source: &TlsSource,
) -> Result<Arc<rustls::sign::CertifiedKey>, tls::TlsError> {
    match source {
        TlsSource::Files { cert, key } => {
            let read = |p: &std::path::PathBuf| {
                std::fs::read(p).map_err(|source| tls::TlsError::Read {
                    path: p.clone(),
                    source,
                })
            };
            tls::certified_key(&read(cert)?, &read(key)?)
        }
        TlsSource::SelfManaged(cfg) => {
            let issued = tls::ensure_secret(client, cfg).await?;
            if tls::patch_ca_bundle(client, &cfg.webhook_configuration, &issued.ca_pem).await? {
                tracing::info!(webhook = %cfg.webhook_configuration, "caBundle updated");
            }
            tls::certified_key(issued.cert_pem.as_bytes(), issued.key_pem.as_bytes())
        }
    }
}

/// Re-reads or renews the certificate periodically; a failure keeps the current one.
async fn refresh_certificate(
    client: Client,
    config: WebhookConfig,
    store: Arc<CertStore>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(config.refresh_interval) => {}
        }
        match load_certificate(&client, &config.tls).await {
            Ok(key) => store.replace(key),
            Err(e) => {
                tracing::warn!(error = %e, category = e.category(), "webhook certificate refresh failed")
            }
        }
    }
}
