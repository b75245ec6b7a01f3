//! The sidecar's metrics. `stoker_trainer_data_wait_seconds_total` is the autoscaler's main
//! signal: its rate is the share of wall time the trainer spent blocked on data.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::decode::SkipReason;
use crate::metrics::LoaderMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabel {
    pub rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

pub struct SidecarMetrics {
    registry: Registry,
    /// Per trainer rank: in synchronous training the most starved rank gates all of them.
    pub data_wait_seconds: Family<RankLabel, Counter<f64, AtomicU64>>,
    pub batches_delivered: Counter,
    pub samples_delivered: Counter,
    pub samples_skipped: Family<ReasonLabel, Counter>,
    pub ready_batches: Gauge,
    pub inflight_batches: Gauge,
    pub retries: Family<ReasonLabel, Counter>,
    pub bytes_received: Counter,
    pub batches_decoded: Family<RouteLabel, Counter>,
    pub workers: Family<StateLabel, Gauge>,
    pub local_share: Gauge<f64, AtomicU64>,
    pub epoch: Gauge,
    /// 1 while delivery is stopped because the source refuses the samples.
    pub source_unavailable: Gauge,
    /// The S3 source of local decode counts here.
    pub loader: std::sync::Arc<LoaderMetrics>,
}

impl Default for SidecarMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl SidecarMetrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        let data_wait_seconds = Family::<RankLabel, Counter<f64, AtomicU64>>::default();
        root.register(
            "stoker_trainer_data_wait_seconds",
            "Seconds the trainer spent blocked waiting for its next batch; rate() of it is the starved share of wall time",
            data_wait_seconds.clone(),
        );
        let mut registry = root;
        let r = registry.sub_registry_with_prefix("stoker_sidecar");
        let batches_delivered = Counter::default();
        r.register(
            "batches_delivered",
            "Batches handed to the trainer",
            batches_delivered.clone(),
        );
        let samples_delivered = Counter::default();
        r.register(
            "samples_delivered",
            "Samples handed to the trainer, skips included",
            samples_delivered.clone(),
        );
        let samples_skipped = Family::<ReasonLabel, Counter>::default();
        r.register(
            "samples_skipped",
            "Samples reported to the trainer as skipped, by reason",
            samples_skipped.clone(),
        );
        let ready_batches = Gauge::default();
        r.register(
            "ready_batches",
            "Decoded batches waiting in the ring for the trainer (queue depth)",
            ready_batches.clone(),
        );
        let inflight_batches = Gauge::default();
        r.register(
            "inflight_batches",
            "Batches requested from decode workers or decoding locally",
            inflight_batches.clone(),
        );
        let retries = Family::<ReasonLabel, Counter>::default();
        r.register(
            "retries",
            "Batches re-sent after a worker failed, timed out or was busy, by reason",
            retries.clone(),
        );
        let bytes_received = Counter::default();
        r.register(
            "bytes_received",
            "Decoded pixel bytes received from decode workers",
            bytes_received.clone(),
        );
        let batches_decoded = Family::<RouteLabel, Counter>::default();
        r.register(
            "batches_decoded",
            "Batches decoded, by route: remote (decode workers) or local",
            batches_decoded.clone(),
        );
        let workers = Family::<StateLabel, Gauge>::default();
        r.register("workers", "Decode workers known, by state", workers.clone());
        let local_share = Gauge::<f64, AtomicU64>::default();
        r.register(
            "local_share",
            "Share of batches decoded in the sidecar (set by flag or the pod's stoker.dev/local-share annotation)",
            local_share.clone(),
        );
        let epoch = Gauge::default();
        r.register("epoch", "Epoch being prefetched", epoch.clone());
        let source_unavailable = Gauge::default();
        r.register(
            "source_unavailable",
            "1 while delivery is stopped because S3 refuses the samples (access, bucket) or kept failing past --source-retry-secs",
            source_unavailable.clone(),
        );
        for reason in SkipReason::ALL {
            let _ = samples_skipped.get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            });
        }
        for route in ["remote", "local"] {
            let _ = batches_decoded.get_or_create(&RouteLabel { route });
        }
        Self {
            registry,
            data_wait_seconds,
            batches_delivered,
            samples_delivered,
            samples_skipped,
            ready_batches,
            inflight_batches,
            retries,
            bytes_received,
            batches_decoded,
            workers,
            local_share,
            epoch,
            source_unavailable,
            loader: std::sync::Arc::new(LoaderMetrics::new()),
        }
    }

    pub fn data_wait(&self, rank: u32) -> Counter<f64, AtomicU64> {
        self.data_wait_seconds
            .get_or_create(&RankLabel { rank })
            .clone()
    }

    pub fn retry(&self, reason: &'static str) {
        self.retries.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// OpenMetrics text: the sidecar's series, then the local S3 source's.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            return String::new();
        }
        let loader = self.loader.encode();
        // One exposition has one `# EOF`: drop the first one and append the loader's series.
        if let Some(body) = out.strip_suffix("# EOF\n") {
            let mut joined = body.to_string();
            joined.push_str(&loader);
            return joined;
        }
        out
    }
}
