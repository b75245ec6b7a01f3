//! Prometheus metrics of the loader (text format at `/metrics`). Every metric is documented in
//! loader/README.md; names are stable because dashboards and the autoscaler read them.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::decode::SkipReason;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    pub stage: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabel {
    pub category: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 50 µs .. ~13 s: a decode is ~1 ms, a slow GET or a whole batch can take seconds.
    Histogram::new(exponential_buckets(0.00005, 2.0, 19))
}

/// All loader metrics. One per process, shared by the source, the engine and the server.
pub struct LoaderMetrics {
    registry: Registry,
    pub stage_seconds: HistogramFamily<StageLabel>,
    pub batch_seconds: Histogram,
    pub samples_in: Counter,
    pub samples_out: Counter,
    pub bytes_in: Counter,
    pub bytes_out: Counter,
    pub skips: Family<ReasonLabel, Counter>,
    pub s3_requests: Family<OpLabel, Counter>,
    pub s3_retries: Counter,
    pub s3_throttles: Counter,
    pub s3_errors: Family<CategoryLabel, Counter>,
    pub inflight_batches: Gauge,
    pub inflight_samples: Gauge,
    pub rejected: Family<ReasonLabel, Counter>,
    pub busy_seconds: Counter<f64, AtomicU64>,
    pub pool_threads: Gauge,
}

impl Default for LoaderMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl LoaderMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("stoker_loader");
        let stage_seconds = HistogramFamily::<StageLabel>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "stage_seconds",
            "Latency per stage: get (one S3 GET incl. retries' last attempt), decode and resize (one sample), pack (one batch)",
            stage_seconds.clone(),
        );
        let batch_seconds = latency_histogram();
        registry.register(
            "batch_seconds",
            "End-to-end time of one DecodeBatch call",
            batch_seconds.clone(),
        );
        let samples_in = Counter::default();
        registry.register("samples_in", "Samples requested", samples_in.clone());
        let samples_out = Counter::default();
        registry.register(
            "samples_out",
            "Samples decoded and returned",
            samples_out.clone(),
        );
        let bytes_in = Counter::default();
        registry.register(
            "bytes_in",
            "Encoded bytes read from S3 or inline",
            bytes_in.clone(),
        );
        let bytes_out = Counter::default();
        registry.register(
            "bytes_out",
            "Decoded uint8 pixel bytes returned",
            bytes_out.clone(),
        );
        let skips = Family::<ReasonLabel, Counter>::default();
        registry.register("skips", "Samples skipped, by reason", skips.clone());
        let s3_requests = Family::<OpLabel, Counter>::default();
        registry.register(
            "s3_requests",
            "S3 requests sent (every attempt), by operation",
            s3_requests.clone(),
        );
        let s3_retries = Counter::default();
        registry.register(
            "s3_retries",
            "S3 attempts retried after a transient failure (throttles included)",
            s3_retries.clone(),
        );
        let s3_throttles = Counter::default();
        registry.register(
            "s3_throttles",
            "S3 answers 503 SlowDown or 429: the store asks to slow down",
            s3_throttles.clone(),
        );
        let s3_errors = Family::<CategoryLabel, Counter>::default();
        registry.register(
            "s3_errors",
            "S3 requests that failed for good, by category",
            s3_errors.clone(),
        );
        let inflight_batches = Gauge::default();
        registry.register(
            "inflight_batches",
            "Batches admitted and not yet answered",
            inflight_batches.clone(),
        );
        let inflight_samples = Gauge::default();
        registry.register(
            "inflight_samples",
            "Samples of the admitted batches",
            inflight_samples.clone(),
        );
        let rejected = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "rejected_batches",
            "Batches refused, by reason: queue_full, draining, requests_in_flight, bucket_outside_pipeline, key_outside_prefix, reply_too_large, too_many_samples, invalid_transform",
            rejected.clone(),
        );
        let busy_seconds = Counter::<f64, AtomicU64>::default();
        registry.register(
            "busy_seconds",
            "CPU seconds the decode pool spent on decode, resize and pack; divide its rate by pool_threads for utilization",
            busy_seconds.clone(),
        );
        let pool_threads = Gauge::default();
        registry.register(
            "pool_threads",
            "Threads in the decode pool",
            pool_threads.clone(),
        );
        // Pre-create the skip reasons so that rate() works from the first scrape.
        for r in SkipReason::ALL {
            let _ = skips.get_or_create(&ReasonLabel { reason: r.as_str() });
        }
        Self {
            registry,
            stage_seconds,
            batch_seconds,
            samples_in,
            samples_out,
            bytes_in,
            bytes_out,
            skips,
            s3_requests,
            s3_retries,
            s3_throttles,
            s3_errors,
            inflight_batches,
            inflight_samples,
            rejected,
            busy_seconds,
            pool_threads,
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    pub fn observe_stage(&self, stage: &'static str, d: Duration) {
        self.stage_seconds
            .get_or_create(&StageLabel { stage })
            .observe(d.as_secs_f64());
    }

    pub fn observe_get(&self, d: Duration, bytes: usize) {
        self.observe_stage("get", d);
        self.bytes_in.inc_by(bytes as u64);
    }

    pub fn s3_request(&self, op: &'static str) {
        self.s3_requests.get_or_create(&OpLabel { op }).inc();
    }

    pub fn s3_retry(&self) {
        self.s3_retries.inc();
    }

    pub fn s3_throttle(&self) {
        self.s3_throttles.inc();
    }

    pub fn s3_error(&self, category: &'static str) {
        self.s3_errors
            .get_or_create(&CategoryLabel { category })
            .inc();
    }

    pub fn skip(&self, reason: SkipReason) {
        self.skips
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub fn reject(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabel { reason }).inc();
    }
}
