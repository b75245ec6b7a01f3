//! Signals read off the reconcile path. One background task per pipeline reads its [`Signals`]
//! from Prometheus, and the nodes' link speeds from the API server, once per decision period
//! and keeps the latest [`SignalRead`]; a reconcile only looks at it. A slow Prometheus (every
//! query may take its whole timeout, 10 s and more on a loaded server) therefore delays
//! decisions, never reconciles: a snapshot that is missing, already decided on or stale means
//! "no decision this time".
//!
//! Each new snapshot sends its pipeline's key on [`SignalCache::subscribe`]'s channel, so the
//! controller reconciles it at once rather than at its next periodic look. A task whose
//! pipeline nobody asked about for three periods ends (the pipeline was deleted, or this
//! replica lost its Lease).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, ListParams};
use tokio::sync::mpsc;

use super::prometheus::PrometheusSignals;
use crate::api::PipelineKey;
use crate::autoscale::ANNOTATION_NIC_GBPS;
use crate::autoscale::metrics::AutoscalerMetrics;
use crate::autoscale::signals::{self, SignalScope, Signals};

/// Why a read failed: the error's category (the metrics label) and its message.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadFailure {
    pub category: &'static str,
    pub message: String,
}

/// One background read of a pipeline's inputs.
#[derive(Clone, Debug)]
pub struct SignalRead {
    /// `Err`: Prometheus could not be read; the decision keeps the size (`MetricsUnavailable`).
    pub signals: Result<Signals, ReadFailure>,
    /// Link speeds (bytes per second) of the nodes annotated with one; `Err`: the node list
    /// failed, and no decision is made on this snapshot.
    pub node_links: Result<BTreeMap<String, f64>, ReadFailure>,
    /// When the read finished.
    pub read_at: Instant,
    /// Counts the pipeline's snapshots, so that each is decided on once.
    pub sequence: u64,
}

/// What a reconcile finds in the cache.
#[derive(Clone, Debug)]
pub enum Latest {
    /// A snapshot not decided on yet and younger than the stale limit.
    Fresh(Arc<SignalRead>),
    /// No read has finished since the last decision (or ever): nothing to decide on.
    Pending,
    /// The newest snapshot is older than the stale limit (its age): nothing to decide on.
    Stale(Duration),
}

struct Entry {
    scope: SignalScope,
    asked_at: Instant,
    latest: Option<Arc<SignalRead>>,
    /// The sequence of the last snapshot a decision used.
    decided: u64,
    refreshing: bool,
}

/// The node list, shared by every pipeline's task: one list per period, not one per pipeline.
type NodeLinks = Option<(Instant, Result<BTreeMap<String, f64>, ReadFailure>)>;

struct Shared {
    reader: PrometheusSignals,
    period: Duration,
    /// Bound on the node list, as on each Prometheus query.
    timeout: Duration,
    metrics: AutoscalerMetrics,
    entries: Mutex<BTreeMap<PipelineKey, Entry>>,
    node_links: Mutex<NodeLinks>,
    triggers: Mutex<Option<mpsc::UnboundedSender<PipelineKey>>>,
}

/// The latest signals of every pipeline, refreshed in the background.
#[derive(Clone)]
pub struct SignalCache {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SignalCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignalCache")
            .field("reader", &self.shared.reader)
            .field("period", &self.shared.period)
            .finish_non_exhaustive()
    }
}

/// A snapshot older than this many periods is stale: its refresher is stuck or gone.
const STALE_PERIODS: u32 = 2;
/// A refresher nobody asked about for this many periods ends.
const IDLE_PERIODS: u32 = 3;

impl SignalCache {
    pub fn new(
        reader: PrometheusSignals,
        period: Duration,
        timeout: Duration,
        metrics: AutoscalerMetrics,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                reader,
                period,
                timeout,
                metrics,
                entries: Mutex::default(),
                node_links: Mutex::default(),
                triggers: Mutex::default(),
            }),
        }
    }

    /// The pipelines whose new snapshot awaits a decision; a new subscription replaces the
    /// previous one (a controller run after a regained Lease).
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<PipelineKey> {
        let (tx, rx) = mpsc::unbounded_channel();
        *lock(&self.shared.triggers) = Some(tx);
        rx
    }

    /// Asks for `pipeline`'s signals over `scope` from now on, starting its refresher when none
    /// runs. Returns at once; the first read lands in the cache later.
    pub fn ask(&self, pipeline: &PipelineKey, scope: SignalScope, client: &Client) {
        let now = Instant::now();
        let start = {
            let mut entries = lock(&self.shared.entries);
            let entry = entries.entry(pipeline.clone()).or_insert_with(|| Entry {
                scope: scope.clone(),
                asked_at: now,
                latest: None,
                decided: 0,
                refreshing: false,
            });
            entry.scope = scope;
            entry.asked_at = now;
            !std::mem::replace(&mut entry.refreshing, true)
        };
        if start {
            let cache = self.clone();
            let pipeline = pipeline.clone();
            let client = client.clone();
            tokio::spawn(async move { cache.refresh(pipeline, client).await });
        }
    }

    /// The newest snapshot of `pipeline` if it is fresh and no decision used it yet; taking it
    /// marks it decided on.
    pub fn take(&self, pipeline: &PipelineKey, now: Instant) -> Latest {
        let mut entries = lock(&self.shared.entries);
        let Some(entry) = entries.get_mut(pipeline) else {
            return Latest::Pending;
        };
        let stale_after = self.shared.period * STALE_PERIODS;
        take_from(entry, now, stale_after)
    }

    /// Stops remembering `pipeline`; its refresher ends at its next turn.
    pub fn forget(&self, pipeline: &PipelineKey) {
        lock(&self.shared.entries).remove(pipeline);
    }

    /// The refresher of one pipeline: read, store, announce, wait a period; until nobody asks.
    async fn refresh(self, pipeline: PipelineKey, client: Client) {
        let shared = &self.shared;
        let mut sequence = 0;
        loop {
            let scope = {
                let mut entries = lock(&shared.entries);
                let Some(entry) = entries.get_mut(&pipeline) else {
                    return;
                };
                if entry.asked_at.elapsed() > shared.period * IDLE_PERIODS {
                    entries.remove(&pipeline);
                    return;
                }
                entry.scope.clone()
            };
            let (signals, node_links) = tokio::join!(
                self.read_signals(&pipeline, &scope),
                self.node_links(&client)
            );
            sequence += 1;
            let snapshot = Arc::new(SignalRead {
                signals,
                node_links,
                read_at: Instant::now(),
                sequence,
            });
            match lock(&shared.entries).get_mut(&pipeline) {
                Some(entry) => entry.latest = Some(snapshot),
                None => return,
            }
            if let Some(tx) = lock(&shared.triggers).as_ref() {
                let _ = tx.send(pipeline.clone());
            }
            tokio::time::sleep(shared.period).await;
        }
    }

    async fn read_signals(
        &self,
        pipeline: &PipelineKey,
        scope: &SignalScope,
    ) -> Result<Signals, ReadFailure> {
        let started = Instant::now();
        let result = self.shared.reader.read(scope).await;
        match result {
            Ok(signals) => {
                tracing::debug!(%pipeline, took = ?started.elapsed(), "autoscaler signals read");
                Ok(signals)
            }
            Err(e) => {
                tracing::warn!(%pipeline, error = %e, category = e.category(),
                    took = ?started.elapsed(), "autoscaler signals unavailable");
                self.shared.metrics.signal_error(e.category());
                Err(ReadFailure {
                    category: e.category(),
                    message: e.to_string(),
                })
            }
        }
    }

    /// The nodes' link speeds, listed at most once per period for all pipelines.
    async fn node_links(&self, client: &Client) -> Result<BTreeMap<String, f64>, ReadFailure> {
        let shared = &self.shared;
        if let Some((at, links)) = lock(&shared.node_links).as_ref()
            && at.elapsed() < shared.period
        {
            return links.clone();
        }
        let nodes = Api::<Node>::all(client.clone());
        let params = ListParams::default();
        let links = match tokio::time::timeout(shared.timeout, nodes.list(&params)).await {
            Ok(Ok(nodes)) => Ok(link_speeds(&nodes.items)),
            Ok(Err(e)) => {
                let category = match &e {
                    kube::Error::Api(s) if s.code == 403 => "nodes_forbidden",
                    _ => "nodes_unreadable",
                };
                tracing::warn!(error = %e, category, "autoscaler: listing nodes failed");
                Err(ReadFailure {
                    category,
                    message: format!("listing Nodes failed: {e}"),
                })
            }
            Err(_) => Err(ReadFailure {
                category: "nodes_unreadable",
                message: format!("listing Nodes took over {:?}", shared.timeout),
            }),
        };
        if let Err(failure) = &links {
            shared.metrics.signal_error(failure.category);
        }
        *lock(&shared.node_links) = Some((Instant::now(), links.clone()));
        links
    }
}

fn take_from(entry: &mut Entry, now: Instant, stale_after: Duration) -> Latest {
    let Some(snapshot) = entry.latest.as_ref() else {
        return Latest::Pending;
    };
    if snapshot.sequence <= entry.decided {
        return Latest::Pending;
    }
    let age = now.saturating_duration_since(snapshot.read_at);
    if age > stale_after {
        return Latest::Stale(age);
    }
    entry.decided = snapshot.sequence;
    Latest::Fresh(snapshot.clone())
}

/// Link speeds, in bytes per second, of the nodes annotated with [`ANNOTATION_NIC_GBPS`]
/// (for nodes whose node-exporter reports none).
pub fn link_speeds(nodes: &[Node]) -> BTreeMap<String, f64> {
    use kube::ResourceExt;
    nodes
        .iter()
        .filter_map(|n| {
            let gbps: f64 = n
                .annotations()
                .get(ANNOTATION_NIC_GBPS)?
                .trim()
                .parse()
                .ok()?;
            (gbps.is_finite() && gbps > 0.0)
                .then(|| (n.name_any(), signals::gbps_to_bytes_per_second(gbps)))
        })
        .collect()
}

/// The map holds plain data, so a panic elsewhere cannot leave it half-written.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(latest: Option<(u64, Instant)>, decided: u64) -> Entry {
        Entry {
            scope: SignalScope {
                namespace: "training".into(),
                pipeline: "qwen".into(),
                trainer_pods: vec![],
                nodes: vec![],
                window: Duration::from_secs(60),
            },
            asked_at: Instant::now(),
            latest: latest.map(|(sequence, read_at)| {
                Arc::new(SignalRead {
                    signals: Ok(Signals::default()),
                    node_links: Ok(BTreeMap::new()),
                    read_at,
                    sequence,
                })
            }),
            decided,
            refreshing: true,
        }
    }

    #[test]
    fn each_fresh_snapshot_is_decided_on_once() {
        let t0 = Instant::now();
        let stale = Duration::from_secs(60);
        assert!(matches!(
            take_from(&mut entry(None, 0), t0, stale),
            Latest::Pending
        ));
        let mut e = entry(Some((1, t0)), 0);
        let first = take_from(&mut e, t0 + Duration::from_secs(1), stale);
        assert!(matches!(first, Latest::Fresh(s) if s.sequence == 1));
        assert!(
            matches!(
                take_from(&mut e, t0 + Duration::from_secs(2), stale),
                Latest::Pending
            ),
            "a snapshot already decided on is no new information"
        );
    }

    #[test]
    fn a_stale_snapshot_is_not_decided_on() {
        let t0 = Instant::now();
        let mut e = entry(Some((3, t0)), 2);
        let later = t0 + Duration::from_secs(61);
        assert!(
            matches!(take_from(&mut e, later, Duration::from_secs(60)), Latest::Stale(age) if age == Duration::from_secs(61))
        );
        assert_eq!(e.decided, 2, "a stale snapshot stays undecided");
    }

    #[test]
    fn link_speeds_come_from_the_annotation() {
        let node = |name: &str, gbps: Option<&str>| -> Node {
            let annotations = gbps.map(|g| serde_json::json!({ ANNOTATION_NIC_GBPS: g }));
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": name, "annotations": annotations },
            }))
            .expect("node")
        };
        let links = link_speeds(&[
            node("gpu-1", Some("100")),
            node("gpu-2", Some("fast")),
            node("gpu-3", Some("-1")),
            node("cpu-1", None),
        ]);
        assert_eq!(links, BTreeMap::from([("gpu-1".into(), 12.5e9)]));
    }
}
