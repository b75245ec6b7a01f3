//! The admission webhooks, a thin HTTPS adapter around two pure cores: [`inject`] (a trainer
//! pod gets its sidecar) and [`authorize`] (a DataPipeline asks of its author the rights it
//! makes the operator use).

pub mod authorize;
pub mod inject;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use axum_server::Handle;
use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::{DataPipeline, LABEL_PIPELINE};
use crate::build::BuildDefaults;
use crate::telemetry::Metrics;
use inject::injection_patch;
use tls::TlsSource;

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
}

#[derive(Clone)]
struct Handler {
    client: Client,
    /// What the injected sidecar is built from: the operator's own [`crate::Config::defaults`].
    defaults: BuildDefaults,
    metrics: Arc<Metrics>,
}

impl Handler {
    /// Admission decision for one pod: refuse a pod that names a missing pipeline or whose
    /// count of trainer processes does not parse (the message names where it was read), else
    /// patch.
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
            Ok(Some(dp)) => match self.defaults.image_refusal(&dp.spec) {
                // A pipeline admitted before the allowed images changed: no trainer runs its
                // image.
                Some(refused) => {
                    self.metrics.webhook("image_refused");
                    allow.deny(format!(
                        "DataPipeline \"{pipeline}\" cannot be injected: {refused}"
                    ))
                }
                None => self.inject(pod, &dp, allow),
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

    /// The injection patch of `pod` for `dp`, as the response.
    fn inject(&self, pod: &Pod, dp: &DataPipeline, allow: AdmissionResponse) -> AdmissionResponse {
        match injection_patch(pod, dp, &self.defaults) {
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
        }
    }

    /// Admission decision for one DataPipeline: refused when it lives in a reserved namespace,
    /// names an image the installation does not allow, or asks for a right its author lacks
    /// (each field named); never mutated.
    async fn admit_pipeline(&self, req: &AdmissionRequest<DataPipeline>) -> AdmissionResponse {
        let allow = AdmissionResponse::from(req);
        if !matches!(req.operation, Operation::Create | Operation::Update) {
            return allow;
        }
        let Some(dp) = req.object.as_ref() else {
            return allow;
        };
        let namespace = req
            .namespace
            .clone()
            .or_else(|| dp.namespace())
            .unwrap_or_default();
        let refused = match authorize::namespace_refusal(&namespace)
            .or_else(|| self.defaults.image_refusal(&dp.spec))
        {
            Some(refused) => Some(refused),
            None => {
                let old = req.old_object.as_ref().map(|o| &o.spec);
                let rights = authorize::required_rights(old, &dp.spec, &self.defaults);
                let answered =
                    authorize::authorize(&self.client, &req.user_info, &namespace, rights).await;
                let user = req.user_info.username.as_deref().unwrap_or("<unknown>");
                authorize::refusal(user, &namespace, &answered)
            }
        };
        match refused {
            Some(message) => {
                self.metrics.webhook("pipeline_refused");
                allow.deny(message)
            }
            None => {
                self.metrics.webhook("pipeline_admitted");
                allow
            }
        }
    }
}

async fn authorize_pipeline(
    State(handler): State<Handler>,
    Json(review): Json<AdmissionReview<DataPipeline>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let response = match TryInto::<AdmissionRequest<DataPipeline>>::try_into(review) {
        Ok(req) => handler.admit_pipeline(&req).await,
        Err(e) => AdmissionResponse::invalid(e.to_string()),
    };
    Json(response.into_review())
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

/// The webhooks' configuration for an operator reached at `base_url` (`https://host:port`)
/// from outside the cluster (a local run, a test), limited to the namespace `namespace`: pod
/// injection at `/mutate` and pipeline authorization at `/authorize`. In a cluster the chart's
/// `templates/webhook.yaml` is the one, with the same rules and selectors.
pub fn url_configuration(
    name: &str,
    namespace: &str,
    base_url: &str,
) -> MutatingWebhookConfiguration {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "inject.stoker.dev",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "timeoutSeconds": 10,
            "clientConfig": {"url": format!("{base_url}{INJECT_PATH}")},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "objectSelector": {"matchExpressions": [
                {"key": LABEL_PIPELINE, "operator": "Exists"},
                {"key": crate::api::LABEL_ROLE, "operator": "NotIn", "values": [crate::api::ROLE_DECODER]}
            ]}
        }, {
            "name": "authorize.stoker.dev",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "timeoutSeconds": 10,
            "clientConfig": {"url": format!("{base_url}{AUTHORIZE_PATH}")},
            "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": ["stoker.dev"],
                       "apiVersions": ["*"], "resources": ["datapipelines"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        }]
    }))
    .expect("a literal MutatingWebhookConfiguration deserializes")
}

/// Points every webhook of `cfg` at `base_url` (instead of a Service, if it named one), each
/// keeping its path: an operator run outside the cluster serving a configuration.
pub fn serve_from(cfg: &mut MutatingWebhookConfiguration, base_url: &str) {
    for hook in cfg.webhooks.iter_mut().flatten() {
        let path = match hook.name.as_str() {
            "authorize.stoker.dev" => AUTHORIZE_PATH,
            _ => INJECT_PATH,
        };
        hook.client_config.service = None;
        hook.client_config.url = Some(format!("{base_url}{path}"));
    }
}

const INJECT_PATH: &str = "/mutate";
const AUTHORIZE_PATH: &str = "/authorize";

/// How long in-flight admissions may finish after `shutdown`: the API server gives each call
/// 10 s (the configuration's timeoutSeconds).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Loads (or issues) the certificate, binds, and serves until `shutdown`.
pub async fn serve(
    client: Client,
    config: WebhookConfig,
    defaults: BuildDefaults,
    metrics: Arc<Metrics>,
    owner: Option<OwnerReference>,
    shutdown: CancellationToken,
) -> Result<WebhookServer, WebhookError> {
    let (cert, key) = load_certificate(&client, &config.tls, owner.as_ref()).await?;
    let rustls = RustlsConfig::from_pem(cert, key)
        .await
        .map_err(tls::TlsError::Load)?;
    let bind_error = |source| WebhookError::Bind {
        addr: config.listen,
        source,
    };
    let listener = std::net::TcpListener::bind(config.listen).map_err(bind_error)?;
    let local_addr = listener.local_addr().map_err(bind_error)?;
    let handle = Handle::new();
    let server = axum_server::from_tcp_rustls(listener, rustls.clone())
        .map_err(bind_error)?
        .handle(handle.clone());
    let app = Router::new()
        .route(INJECT_PATH, post(mutate))
        .route(AUTHORIZE_PATH, post(authorize_pipeline))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Handler {
            client: client.clone(),
            defaults,
            metrics,
        });

    tokio::spawn(refresh_certificate(
        client, config, rustls, handle, owner, shutdown,
    ));
    let task = tokio::spawn(async move {
        if let Err(e) = server.serve(app.into_make_service()).await {
            tracing::error!(error = %e, "webhook server stopped");
        }
    });
    tracing::info!(%local_addr, "webhook listening");
    Ok(WebhookServer { local_addr, task })
}

/// The serving certificate and its key, PEM; issued first when self-managed (its Secret
/// belonging to `owner`).
async fn load_certificate(
    client: &Client,
    source: &TlsSource,
    owner: Option<&OwnerReference>,
) -> Result<(Vec<u8>, Vec<u8>), tls::TlsError> {
    match source {
        TlsSource::Files { cert, key } => {
            let read = |p: &std::path::PathBuf| {
                std::fs::read(p).map_err(|source| tls::TlsError::Read {
                    path: p.clone(),
                    source,
                })
            };
            Ok((read(cert)?, read(key)?))
        }
        TlsSource::SelfManaged(cfg) => {
            let issued = tls::ensure_secret(client, cfg, owner).await?;
            if tls::patch_ca_bundle(client, &cfg.webhook_configuration, &issued.trust_bundle)
                .await?
            {
                tracing::info!(webhook = %cfg.webhook_configuration, "caBundle updated");
            }
            Ok((issued.cert_pem.into_bytes(), issued.key_pem.into_bytes()))
        }
    }
}

/// Re-reads or renews the certificate periodically (a failure keeps the current one) and stops
/// the server gracefully on `shutdown`.
async fn refresh_certificate(
    client: Client,
    config: WebhookConfig,
    rustls: RustlsConfig,
    server: Handle<std::net::SocketAddr>,
    owner: Option<OwnerReference>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => {
                server.graceful_shutdown(Some(SHUTDOWN_GRACE));
                return;
            }
            () = tokio::time::sleep(config.refresh_interval) => {}
        }
        let reloaded = match load_certificate(&client, &config.tls, owner.as_ref()).await {
            Ok((cert, key)) => rustls
                .reload_from_pem(cert, key)
                .await
                .map_err(tls::TlsError::Load),
            Err(e) => Err(e),
        };
        if let Err(e) = reloaded {
            tracing::warn!(error = %e, category = e.category(), "webhook certificate refresh failed");
        }
    }
}
