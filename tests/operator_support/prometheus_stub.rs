//! A stand-in for Prometheus' query API that answers every instant query with an empty vector
//! after a delay the test sets: a Prometheus that is slow (or fast) but healthy. The real
//! Prometheus is what `autoscale_prometheus.rs` and `autoscale_e2e.rs` read; this one is for
//! what only a misbehaving server shows.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::any;

#[derive(Clone)]
pub struct PrometheusStub {
    pub addr: SocketAddr,
    queries: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
}

impl PrometheusStub {
    /// Serves on loopback until the test's runtime ends; each query waits `delay`.
    pub async fn start(delay: Duration) -> Self {
        let queries = Arc::new(AtomicUsize::new(0));
        let answered = Arc::new(AtomicUsize::new(0));
        let (q, a) = (queries.clone(), answered.clone());
        let app = Router::new().route(
            "/api/v1/query",
            any(move || {
                let (q, a) = (q.clone(), a.clone());
                async move {
                    q.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(delay).await;
                    a.fetch_add(1, Ordering::SeqCst);
                    (
                        [("content-type", "application/json")],
                        r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#,
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            queries,
            answered,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queries received so far.
    pub fn queries(&self) -> usize {
        self.queries.load(Ordering::SeqCst)
    }

    /// Queries answered so far.
    pub fn answered(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }
}
