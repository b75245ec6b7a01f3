//! A stand-in for the `/metrics` endpoints of trainers' sidecars, decoders and node-exporters:
//! one HTTP endpoint whose counters grow at rates the test sets, carrying the labels
//! Prometheus' relabelling gives the real ones (`namespace`, `pipeline`, `pod`, `role`; `node`,
//! `device`), scraped every second by a real Prometheus ([`ScrapedExporter`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use stoker_testenv::prometheus::{Prometheus, PrometheusOptions};

/// The labels of a pod's series, as the PodMonitors relabel them.
pub fn pod_labels(namespace: &str, pipeline: &str, pod: &str, role: &str) -> String {
    format!(r#"namespace="{namespace}",pipeline="{pipeline}",pod="{pod}",role="{role}""#)
}

/// The labels of a node-exporter series of one interface.
pub fn nic_labels(node: &str, device: &str) -> String {
    format!(r#"device="{device}",node="{node}""#)
}

enum Value {
    /// `base` at `since`, then `per_second` more every second.
    Counter {
        base: f64,
        per_second: f64,
        since: Instant,
    },
    Gauge(f64),
}

impl Value {
    fn at(&self, now: Instant) -> f64 {
        match self {
            Value::Counter {
                base,
                per_second,
                since,
            } => base + per_second * now.duration_since(*since).as_secs_f64(),
            Value::Gauge(v) => *v,
        }
    }
}

/// Series by metric name, then labels: the text format wants a metric's lines together.
type SeriesMap = BTreeMap<(&'static str, String), Value>;

/// An HTTP `/metrics` endpoint on loopback serving the series set on it.
#[derive(Clone)]
pub struct Exporter {
    addr: SocketAddr,
    series: Arc<Mutex<SeriesMap>>,
}

impl Exporter {
    pub async fn start() -> Self {
        let series: Arc<Mutex<SeriesMap>> = Arc::default();
        let served = series.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let text = render(&lock(&served), Instant::now());
                async move { text }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the exporter");
        let addr = listener.local_addr().expect("exporter address");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, series }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on the counter grows by `per_second` every second; what it counted so far stays,
    /// so that it never goes back (Prometheus would read a reset).
    pub fn counter(&self, name: &'static str, labels: &str, per_second: f64) {
        let now = Instant::now();
        let mut series = lock(&self.series);
        let base = series
            .get(&(name, labels.to_string()))
            .map_or(0.0, |v| v.at(now));
        series.insert(
            (name, labels.to_string()),
            Value::Counter {
                base,
                per_second,
                since: now,
            },
        );
    }

    pub fn gauge(&self, name: &'static str, labels: &str, value: f64) {
        lock(&self.series).insert((name, labels.to_string()), Value::Gauge(value));
    }
}

fn lock(series: &Mutex<SeriesMap>) -> std::sync::MutexGuard<'_, SeriesMap> {
    series.lock().unwrap_or_else(|e| e.into_inner())
}

/// The text exposition format at `now`.
fn render(series: &SeriesMap, now: Instant) -> String {
    let mut out = String::new();
    let mut typed = None;
    for ((name, labels), value) in series {
        if typed != Some(*name) {
            let kind = match value {
                Value::Counter { .. } => "counter",
                Value::Gauge(_) => "gauge",
            };
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            typed = Some(*name);
        }
        out.push_str(&format!("{name}{{{labels}}} {}\n", value.at(now)));
    }
    out
}

/// An [`Exporter`] and a real Prometheus (testenv's, Debian's binary) scraping it every second
/// through the file_sd target list a production setup would fill from Kubernetes. The exporter's
/// labels pass through unchanged: Prometheus adds only `job` and `instance`.
pub struct ScrapedExporter {
    pub exporter: Exporter,
    pub prometheus: Prometheus,
    targets: PathBuf,
}

impl ScrapedExporter {
    pub async fn start() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let exporter = Exporter::start().await;
        let targets = std::env::temp_dir().join(format!(
            "stoker-scrape-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&targets).expect("create the target directory");
        let loaders = serde_json::json!([{ "targets": [exporter.addr().to_string()] }]);
        std::fs::write(targets.join("loaders.json"), loaders.to_string())
            .expect("write loaders.json");
        // Node series come from the same exporter: a second job would count them twice.
        std::fs::write(targets.join("nodes.json"), "[]").expect("write nodes.json");
        let dir = targets.clone();
        // Start-up blocks until Prometheus answers /-/ready.
        let prometheus =
            tokio::task::spawn_blocking(move || Prometheus::start(PrometheusOptions::new(dir)))
                .await
                .expect("Prometheus start-up panicked")
                .unwrap_or_else(|e| panic!("{e:#}"));
        Self {
            exporter,
            prometheus,
            targets,
        }
    }

    /// The first value an instant query returns; `None` while it returns nothing (or Prometheus
    /// does not answer).
    pub async fn value(&self, promql: &str) -> Option<f64> {
        let client =
            prometheus_http_query::Client::try_from(self.prometheus.url().as_str()).ok()?;
        let result = client.query(promql).get().await.ok()?;
        result
            .data()
            .as_vector()?
            .first()
            .map(|s| s.sample().value())
    }

    /// Stops Prometheus (blocks up to its shutdown grace): what an outage looks like to readers.
    pub fn stop_prometheus(&self) {
        self.prometheus.stop();
    }
}

impl Drop for ScrapedExporter {
    fn drop(&mut self) {
        self.prometheus.stop();
        let _ = std::fs::remove_dir_all(&self.targets);
    }
}
