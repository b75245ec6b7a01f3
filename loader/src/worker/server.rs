//! Wiring of the worker process: gRPC server, HTTP endpoints, decode pool and the drain.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures::{FutureExt, StreamExt};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use stoker_contract::{DecodeArgs, LoaderCommand, MAX_GRPC_MESSAGE_BYTES};

use super::client::MAX_FRAME;
use super::gate::RequestGate;
use super::limits::{CGROUP_CPU_MAX, decode_threads};
use super::scope::SourceScope;
use super::service::{DecodeWorker, WorkerState};
use super::tls::PipelineTls;
use crate::decode::DecodeLimits;
use crate::metrics::LoaderMetrics;
use crate::proto::decode_service_server::DecodeServiceServer;
use crate::source::{S3Config, S3Source};

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// Decode threads; 0 means the container's CPU limit, else one per core.
    pub threads: usize,
    /// Batches admitted at once (fetching, queued or decoding); more are refused. 0 means
    /// [`DecodeArgs::admitted_batches`].
    pub queue_depth: usize,
    pub max_batch_samples: usize,
    pub limits: DecodeLimits,
    /// None: only inline samples can be decoded.
    pub s3: Option<S3Config>,
    /// The pipeline's bucket and prefix; None (local runs, bench) reads any, with a warning.
    pub scope: Option<SourceScope>,
    /// Longest wait for in-flight batches after SIGTERM.
    pub drain_timeout: Duration,
    /// Mutual TLS with the pipeline's certificate; None (local runs, bench) serves plaintext.
    pub tls: Option<Arc<PipelineTls>>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            grpc_addr: ([0, 0, 0, 0], stoker_contract::DECODER_GRPC_PORT).into(),
            http_addr: ([0, 0, 0, 0], stoker_contract::DECODER_METRICS_PORT).into(),
            threads: 0,
            queue_depth: 0,
            max_batch_samples: stoker_contract::MAX_BATCH_SAMPLES as usize,
            limits: DecodeLimits::default(),
            s3: None,
            scope: None,
            drain_timeout: Duration::from_secs(60),
            tls: None,
        }
    }
}

/// Headers of one request: gRPC's are a few hundred bytes.
const REQUEST_HEADER_BYTES: u32 = 16 << 10;

/// A bound, not yet serving, worker: addresses are known (port 0 resolved) before serving.
pub struct DecodeServer {
    config: WorkerConfig,
    grpc: TcpListener,
    http: TcpListener,
    pub state: Arc<WorkerState>,
}

impl DecodeServer {
    pub async fn bind(config: WorkerConfig) -> anyhow::Result<Self> {
        let grpc = TcpListener::bind(config.grpc_addr).await?;
        let http = TcpListener::bind(config.http_addr).await?;
        let state = Arc::new(WorkerState::new(Arc::new(LoaderMetrics::new())));
        Ok(Self {
            config,
            grpc,
            http,
            state,
        })
    }

    pub fn grpc_addr(&self) -> std::io::Result<SocketAddr> {
        self.grpc.local_addr()
    }

    pub fn http_addr(&self) -> std::io::Result<SocketAddr> {
        self.http.local_addr()
    }

    /// Serves until `shutdown` resolves, then drains: readiness turns 503, new batches are
    /// refused with UNAVAILABLE, in-flight batches finish (up to the drain timeout), and the
    /// servers stop.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let threads = decode_threads(self.config.threads, std::path::Path::new(CGROUP_CPU_MAX));
        let sizing = DecodeArgs {
            queue_depth: self.config.queue_depth,
            max_source_pixels: self.config.limits.max_pixels,
            ..DecodeArgs::parse_flags(std::iter::empty::<String>())?
        };
        let queue_depth = sizing.admitted_batches(threads);
        let requests_in_flight = sizing.requests_in_flight(threads);
        match &self.config.scope {
            Some(scope) => {
                tracing::info!(bucket = %scope.bucket, prefix = %scope.prefix, "serving only this source");
            }
            None => tracing::warn!(
                "no --bucket: requests may name any bucket and key the S3 credentials can read"
            ),
        }
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("decode-{i}"))
                .build()?,
        );
        let source = match &self.config.s3 {
            Some(cfg) => Some(S3Source::connect(cfg, self.state.metrics.clone()).await),
            None => None,
        };
        let worker = DecodeWorker::new(
            self.state.clone(),
            source,
            pool,
            queue_depth,
            self.config.limits,
            self.config.max_batch_samples,
        )
        .with_scope(self.config.scope.clone());
        // Requests carry keys, not pixels: a larger one is refused from its length prefix,
        // before its body is buffered.
        let service = DecodeServiceServer::new(worker)
            .max_decoding_message_size(DecodeArgs::MAX_REQUEST_BYTES as usize)
            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES as usize);
        let service = RequestGate::new(service, requests_in_flight, self.state.metrics.clone());

        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut grpc_stop = stop_rx.clone();
        let stopped = async move {
            let _ = grpc_stop.wait_for(|s| *s).await;
        };
        // These windows bound what a client may send ahead (requests, small); the client's own
        // windows let replies stream.
        let router = tonic::transport::Server::builder()
            .initial_stream_window_size(DecodeArgs::MAX_REQUEST_BYTES as u32)
            .initial_connection_window_size(2 * DecodeArgs::MAX_REQUEST_BYTES as u32)
            .max_frame_size(MAX_FRAME)
            .http2_max_header_list_size(REQUEST_HEADER_BYTES)
            .add_service(service);
        let grpc = match &self.config.tls {
            Some(tls) => {
                tracing::info!(dir = %tls.dir().display(), "serving gRPC over mutual TLS");
                let incoming = tls.clone().incoming(self.grpc);
                router
                    .serve_with_incoming_shutdown(incoming, stopped)
                    .boxed()
            }
            None => {
                let incoming = TcpListenerStream::new(self.grpc).map(|conn| {
                    if let Ok(s) = &conn {
                        let _ = s.set_nodelay(true);
                    }
                    conn
                });
                router
                    .serve_with_incoming_shutdown(incoming, stopped)
                    .boxed()
            }
        };

        let app = Router::new()
            .route("/metrics", get(metrics_handler))
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(ready_handler))
            .with_state(self.state.clone());
        let mut http_stop = stop_rx.clone();
        let http = axum::serve(self.http, app).with_graceful_shutdown(async move {
            let _ = http_stop.wait_for(|s| *s).await;
        });

        let state = self.state.clone();
        let drain_timeout = self.config.drain_timeout;
        let drain = async move {
            shutdown.await;
            tracing::info!(
                inflight = state.inflight(),
                "draining: refusing new batches"
            );
            state.start_draining();
            let deadline = Instant::now() + drain_timeout;
            while state.inflight() > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if state.inflight() > 0 {
                tracing::warn!(
                    inflight = state.inflight(),
                    "drain timeout; stopping anyway"
                );
            } else {
                tracing::info!("drained");
            }
            let _ = stop_tx.send(true);
        };
        tracing::info!(
            threads,
            queue_depth,
            requests_in_flight,
            "decode worker serving"
        );
        let (g, h, ()) = tokio::join!(grpc, async { http.await }, drain);
        g?;
        h?;
        Ok(())
    }
}

async fn metrics_handler(
    State(state): State<Arc<WorkerState>>,
) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn ready_handler(State(state): State<Arc<WorkerState>>) -> (StatusCode, &'static str) {
    if state.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else {
        (StatusCode::OK, "ready")
    }
}
