//! The sidecar's HTTP port: `/metrics`, `/healthz`, `/readyz` (passes only once the trainer's
//! unix socket is listening: the injected startup probe) and `GET /local-share` (the share of
//! batches decoded in the sidecar). The port takes no writes: the share is changed through the
//! pod's annotation (see `discovery::kube::follow_local_share`), which the API server guards.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use super::pipeline::Pipeline;

#[derive(Clone)]
pub struct HttpState {
    /// One per local rank served.
    pub pipelines: Vec<Arc<Pipeline>>,
    pub socket_listening: Arc<AtomicBool>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/local-share", get(get_share))
        .with_state(state)
}

async fn metrics(State(s): State<HttpState>) -> impl axum::response::IntoResponse {
    use super::metrics::StateLabel;
    let Some(first) = s.pipelines.first() else {
        return (
            [(axum::http::header::CONTENT_TYPE, "text/plain")],
            String::new(),
        );
    };
    let fleet = first.fleet.counts();
    let workers = &first.metrics.workers;
    let ready: usize = s.pipelines.iter().map(|p| p.delivery.ready_batches()).sum();
    first.metrics.ready_batches.set(ready as i64);
    workers
        .get_or_create(&StateLabel { state: "available" })
        .set(fleet.available as i64);
    workers
        .get_or_create(&StateLabel { state: "set_aside" })
        .set(fleet.set_aside as i64);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        first.metrics.encode(),
    )
}

async fn ready(State(s): State<HttpState>) -> (StatusCode, &'static str) {
    if s.socket_listening.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "socket not listening")
    }
}

async fn get_share(State(s): State<HttpState>) -> String {
    let share = s.pipelines.first().map_or(0.0, |p| p.local_share());
    format!("{share}\n")
}
