//! Metrics, health endpoints and logging.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::autoscale::metrics::AutoscalerMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CategoryLabel {
    category: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FleetLabels {
    namespace: String,
    pipeline: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

/// The operator's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    errors: Family<CategoryLabel, Counter>,
    duration: Histogram,
    fleet: Family<FleetLabels, Gauge>,
    webhook: Family<ResultLabel, Counter>,
    children: Family<ResultLabel, Counter>,
    leader: Gauge,
    ready: AtomicBool,
    /// Every input signal and decision of the autoscaler, under `stoker_autoscaler_`.
    pub autoscaler: AutoscalerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("stoker");
        let reconciles = Counter::default();
        let errors = Family::<CategoryLabel, Counter>::default();
        let duration = Histogram::new(exponential_buckets(0.001, 1.5, 24));
        let fleet = Family::<FleetLabels, Gauge>::default();
        let webhook = Family::<ResultLabel, Counter>::default();
        let children = Family::<ResultLabel, Counter>::default();
        let leader = Gauge::default();
        registry.register("reconciles", "DataPipeline reconciles", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Failed reconciles by error category",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile",
            duration.clone(),
        );
        registry.register(
            "decoders",
            "Decoder pods per pipeline by state (desired, ready, draining)",
            fleet.clone(),
        );
        registry.register(
            "webhook_requests",
            "Admission requests by result",
            webhook.clone(),
        );
        registry.register(
            "child_applies",
            "Children (Service, NetworkPolicy, Role, RoleBinding) a reconcile applied, or found already as built",
            children.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica runs the controller",
            leader.clone(),
        );
        let autoscaler = AutoscalerMetrics::register(&mut registry);
        Self {
            registry,
            reconciles,
            errors,
            duration,
            fleet,
            webhook,
            children,
            leader,
            ready: AtomicBool::new(false),
            autoscaler,
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, seconds: f64) {
        self.reconciles.inc();
        self.duration.observe(seconds);
    }

    /// One reconcile's children: `true` for each it applied, `false` for each already as built.
    pub fn children_applied(&self, applied: &[bool]) {
        for &a in applied {
            let result = if a { "applied" } else { "unchanged" };
            self.children
                .get_or_create(&ResultLabel {
                    result: result.to_string(),
                })
                .inc();
        }
    }

    pub fn reconcile_error(&self, category: &str) {
        self.errors
            .get_or_create(&CategoryLabel {
                category: category.to_string(),
            })
            .inc();
    }

    pub fn fleet(&self, namespace: &str, pipeline: &str, desired: i32, ready: i32, draining: i32) {
        for (state, v) in [
            ("desired", desired),
            ("ready", ready),
            ("draining", draining),
        ] {
            self.fleet
                .get_or_create(&FleetLabels {
                    namespace: namespace.to_string(),
                    pipeline: pipeline.to_string(),
                    state: state.to_string(),
                })
                .set(i64::from(v));
        }
    }

    pub fn forget_pipeline(&self, namespace: &str, pipeline: &str) {
        for state in ["desired", "ready", "draining"] {
            self.fleet.remove(&FleetLabels {
                namespace: namespace.to_string(),
                pipeline: pipeline.to_string(),
                state: state.to_string(),
            });
        }
    }

    pub fn webhook(&self, result: &str) {
        self.webhook
            .get_or_create(&ResultLabel {
                result: result.to_string(),
            })
            .inc();
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` over plain HTTP until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move { m.encode() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        )
        .with_state(metrics);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    });
    Ok((local, task))
}

/// Structured logs: JSON when `json`, else human-readable; level from `RUST_LOG`.
pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::autoscale::policy::{AutoscalingPolicy, DecoderFleet, ScaleHistory, decide};

    #[test]
    fn the_operator_endpoint_shows_the_autoscaler_decisions() {
        let metrics = Metrics::default();
        let fleet = DecoderFleet {
            replicas: 3,
            trainers: 1,
            ..DecoderFleet::default()
        };
        let d = decide(
            &AutoscalingPolicy::default(),
            &fleet,
            None,
            &ScaleHistory::default(),
            Timestamp::UNIX_EPOCH,
        );
        metrics.autoscaler.record("training", "qwen", &d);
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"stoker_autoscaler_current_decoders{namespace="training",pipeline="qwen"} 3"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"stoker_autoscaler_condition{namespace="training",pipeline="qwen",condition="MetricsUnavailable"} 1"#), "{text}");
    }
}
