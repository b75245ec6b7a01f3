//! `WorkerPool`: the decode workers this sidecar knows, with their outstanding requests and
//! health. Batches go to the healthy worker with the fewest outstanding requests (ties taken in
//! turn, so a lightly loaded fleet still spreads its work and finds dead workers); a worker
//! that fails `max_failures` times in a row is set aside for `set_aside_for`, then tried again.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::OnceCell;

use crate::worker::{DecodeClient, PipelineTls};

#[derive(Debug, Clone, Copy)]
pub struct FleetPolicy {
    pub max_failures: u32,
    pub set_aside_for: Duration,
}

impl Default for FleetPolicy {
    fn default() -> Self {
        Self {
            max_failures: 3,
            set_aside_for: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Default)]
struct Health {
    consecutive_failures: u32,
    set_aside_until: Option<Instant>,
}

pub struct DecodeWorkerHandle {
    pub endpoint: String,
    tls: Option<Arc<PipelineTls>>,
    client: OnceCell<DecodeClient>,
    outstanding: AtomicUsize,
    health: Mutex<Health>,
}

impl DecodeWorkerHandle {
    fn new(endpoint: String, tls: Option<Arc<PipelineTls>>) -> Self {
        Self {
            endpoint,
            tls,
            client: OnceCell::new(),
            outstanding: AtomicUsize::new(0),
            health: Mutex::new(Health::default()),
        }
    }

    /// The connected client (connecting on first use; tonic reconnects it later by itself).
    pub async fn client(&self) -> Result<DecodeClient, tonic::transport::Error> {
        self.client
            .get_or_try_init(|| DecodeClient::connect_with(self.endpoint.clone(), self.tls.clone()))
            .await
            .cloned()
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::SeqCst)
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn available(&self, now: Instant) -> bool {
        self.health().set_aside_until.is_none_or(|t| t <= now)
    }
}

/// Counts a request as outstanding on its worker until dropped.
pub struct Outstanding(Arc<DecodeWorkerHandle>);

impl Outstanding {
    pub fn worker(&self) -> &Arc<DecodeWorkerHandle> {
        &self.0
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The decode workers a sidecar sends batches to, as discovery last saw them, and how it
/// picks one (least loaded, ties in turn). Not the operator's `DecoderFleet` (the autoscaler's
/// view of the pods): this is one sidecar's set of connections.
#[derive(Default)]
pub struct WorkerPool {
    workers: Mutex<HashMap<String, Arc<DecodeWorkerHandle>>>,
    policy: FleetPolicy,
    /// Where the next tie among equally loaded workers starts.
    turn: AtomicUsize,
    /// The pipeline's certificate, presented to every worker; None: plaintext.
    tls: Option<Arc<PipelineTls>>,
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FleetCounts {
    pub available: usize,
    pub set_aside: usize,
}

impl WorkerPool {
    pub fn new(policy: FleetPolicy) -> Self {
        Self {
            workers: Mutex::default(),
            policy,
            turn: AtomicUsize::new(0),
            tls: None,
        }
    }

    /// Connects to workers over mutual TLS with the pipeline's certificate.
    pub fn with_tls(mut self, tls: Option<Arc<PipelineTls>>) -> Self {
        self.tls = tls;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<DecodeWorkerHandle>>> {
        self.workers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Replaces the set of workers with what discovery found; known workers keep their
    /// connection and health, requests in flight to removed ones finish on their own.
    pub fn update(&self, endpoints: &[String]) -> (usize, usize) {
        let mut workers = self.lock();
        let wanted: HashSet<&String> = endpoints.iter().collect();
        let before = workers.len();
        workers.retain(|e, _| wanted.contains(e));
        let removed = before - workers.len();
        let mut added = 0;
        for e in endpoints {
            workers.entry(e.clone()).or_insert_with(|| {
                added += 1;
                Arc::new(DecodeWorkerHandle::new(e.clone(), self.tls.clone()))
            });
        }
        (added, removed)
    }

    /// The available worker with the fewest outstanding requests, skipping `tried`; among
    /// equally loaded ones, each in turn. Without the turn, a fleet that keeps up (nothing
    /// outstanding between batches) would send every batch to the same worker.
    pub fn pick(&self, tried: &HashSet<String>) -> Option<Outstanding> {
        let now = Instant::now();
        let workers = self.lock();
        let mut candidates: Vec<&Arc<DecodeWorkerHandle>> = workers
            .values()
            .filter(|w| !tried.contains(&w.endpoint) && w.available(now))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        candidates.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        let n = candidates.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        // `min_by_key` keeps the first of equal minima: the one whose turn it is.
        let best = (0..n)
            .map(|i| candidates[(start + i) % n])
            .min_by_key(|w| w.outstanding())?
            .clone();
        best.outstanding.fetch_add(1, Ordering::SeqCst);
        Some(Outstanding(best))
    }

    pub fn counts(&self) -> FleetCounts {
        let now = Instant::now();
        let workers = self.lock();
        let available = workers.values().filter(|w| w.available(now)).count();
        FleetCounts {
            available,
            set_aside: workers.len() - available,
        }
    }

    pub fn succeeded(&self, w: &DecodeWorkerHandle) {
        *w.health() = Health::default();
    }

    /// Records a failure; returns true when the worker is now set aside.
    pub fn failed(&self, w: &DecodeWorkerHandle) -> bool {
        let mut h = w.health();
        h.consecutive_failures += 1;
        if h.consecutive_failures >= self.policy.max_failures {
            h.consecutive_failures = 0;
            h.set_aside_until = Some(Instant::now() + self.policy.set_aside_for);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_outstanding_first_and_failing_workers_are_set_aside() {
        let fleet = WorkerPool::new(FleetPolicy {
            max_failures: 2,
            set_aside_for: Duration::from_secs(60),
        });
        fleet.update(&["http://a".into(), "http://b".into()]);
        let none = HashSet::new();
        let first = fleet.pick(&none).unwrap();
        let second = fleet.pick(&none).unwrap();
        assert_ne!(
            first.worker().endpoint,
            second.worker().endpoint,
            "spread by outstanding"
        );
        let a = first.worker().clone();
        drop(first);
        assert_eq!(fleet.pick(&none).unwrap().worker().endpoint, a.endpoint);
        assert!(!fleet.failed(&a));
        assert!(fleet.failed(&a), "second failure in a row sets it aside");
        assert_eq!(
            fleet.counts(),
            FleetCounts {
                available: 1,
                set_aside: 1
            }
        );
        for _ in 0..3 {
            assert_ne!(fleet.pick(&none).unwrap().worker().endpoint, a.endpoint);
        }
        let tried: HashSet<String> = [second.worker().endpoint.clone()].into_iter().collect();
        assert!(
            fleet.pick(&tried).is_none(),
            "nothing left once the only healthy one was tried"
        );
        assert_eq!(fleet.update(&["http://c".into()]), (1, 2));
    }

    #[test]
    fn equally_loaded_workers_take_turns() {
        let fleet = WorkerPool::default();
        fleet.update(&["http://a".into(), "http://b".into(), "http://c".into()]);
        let none = HashSet::new();
        // Each request finishes before the next is sent: nothing is ever outstanding.
        let picked: Vec<String> = (0..6)
            .map(|_| fleet.pick(&none).unwrap().worker().endpoint.clone())
            .collect();
        for endpoint in ["http://a", "http://b", "http://c"] {
            let times = picked.iter().filter(|p| *p == endpoint).count();
            assert_eq!(times, 2, "{endpoint} in {picked:?}");
        }
    }
}
