//! Where the autoscaler's inputs come from, and the one adapter between them and its pure
//! domain ([`crate::autoscale`]): Prometheus ([`prometheus`]) and the node list, both read in
//! the background ([`cache`], never inside a reconcile), and the pipeline's pods from the
//! controller's caches. The controller's observe step calls [`AutoscalerHandle::observe`]
//! (which never waits on Prometheus), its decide step [`AutoscalerHandle::decide`] (no I/O).

pub mod cache;
pub mod prometheus;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::reflector::ObjectRef;

use crate::api::{DataPipeline, PipelineKey};
use crate::autoscale::metrics::AutoscalerMetrics;
use crate::autoscale::{Autoscaler, AutoscalingPolicy, DecoderFleet, ScaleDecision, Signals};
use cache::{Latest, ReadFailure, SignalCache};
use prometheus::SignalError;

/// Operator-wide autoscaler settings (flags or chart values), for what the CRD does not carry.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoscalerSettings {
    /// Prometheus' base URL; `None` reads nothing and keeps every size (`MetricsUnavailable`).
    pub prometheus_url: Option<String>,
    /// How often a pipeline's signals are read and decided on.
    pub period: Duration,
    /// Bound on each Prometheus query.
    pub query_timeout: Duration,
    pub templates: prometheus::QueryTemplates,
    /// Window, headroom, tolerance, S3 and local-decode limits, default link speed: every
    /// pipeline starts from these; the spec's fields override the rest.
    pub defaults: AutoscalingPolicy,
}

impl Default for AutoscalerSettings {
    fn default() -> Self {
        Self {
            prometheus_url: None,
            period: Duration::from_secs(30),
            query_timeout: Duration::from_secs(5),
            templates: prometheus::QueryTemplates::default(),
            defaults: AutoscalingPolicy::default(),
        }
    }
}

impl AutoscalerSettings {
    /// The reader for `prometheus_url`, if one is set.
    pub fn reader(&self) -> Result<Option<prometheus::PrometheusSignals>, prometheus::SignalError> {
        self.prometheus_url
            .as_deref()
            .map(|url| {
                prometheus::PrometheusSignals::new(url, self.templates.clone(), self.query_timeout)
            })
            .transpose()
    }
}

/// What the observe step read for a decision that is due: the fleet as the domain sees it
/// and the signals (`None`: Prometheus could not be read, or none is configured).
#[derive(Clone, Debug)]
pub struct AutoscaleInput {
    pub fleet: DecoderFleet,
    pub signals: Option<Signals>,
}

/// Why the autoscaler could not decide for a pipeline: shown as `Degraded` (reason and
/// message) until a decision succeeds again.
#[derive(Clone, Debug, PartialEq)]
pub struct Degradation {
    pub reason: &'static str,
    pub message: String,
}

/// The `Degraded` reason while the node list fails.
pub const NODES_UNREADABLE: &str = "AutoscalerNodesUnreadable";

/// The autoscaler the controller shares across reconciles.
pub struct AutoscalerHandle {
    settings: AutoscalerSettings,
    /// `None` without a Prometheus URL: every decision keeps the size (`MetricsUnavailable`).
    cache: Option<SignalCache>,
    state: Mutex<Autoscaler>,
    degraded: Mutex<BTreeMap<PipelineKey, Degradation>>,
    metrics: AutoscalerMetrics,
}

impl AutoscalerHandle {
    pub fn new(
        settings: AutoscalerSettings,
        metrics: AutoscalerMetrics,
    ) -> Result<Self, SignalError> {
        let cache = settings.reader()?.map(|reader| {
            SignalCache::new(
                reader,
                settings.period,
                settings.query_timeout,
                metrics.clone(),
            )
        });
        Ok(Self {
            cache,
            settings,
            state: Mutex::new(Autoscaler::default()),
            degraded: Mutex::default(),
            metrics,
        })
    }

    /// Pipelines to reconcile because a new snapshot of their signals is ready. Each call
    /// replaces the previous subscription (one controller runs at a time).
    pub fn reconcile_triggers(&self) -> BoxStream<'static, ObjectRef<DataPipeline>> {
        let Some(cache) = &self.cache else {
            return futures::stream::pending().boxed();
        };
        let mut rx = cache.subscribe();
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
            .map(|key: PipelineKey| ObjectRef::new(&key.name).within(&key.namespace))
            .boxed()
    }

    /// The input of a decision for `dp` when there is something new to decide on (`None`
    /// otherwise: the last decision stands). With Prometheus, that is a fresh snapshot from
    /// the background read; without, once per period. Prometheus being unreachable is an
    /// input too (no signals: keep the size, `MetricsUnavailable`). Never waits: the first
    /// call for a pipeline starts its background read.
    pub fn observe(
        &self,
        client: &Client,
        dp: &DataPipeline,
        pods: FleetPods<'_>,
        now: Timestamp,
    ) -> Option<AutoscaleInput> {
        let pipeline = PipelineKey::of(dp);
        let mut fleet = observe_fleet(dp, &pods);
        let Some(cache) = &self.cache else {
            let due = lock(&self.state).due(&pipeline, now, self.settings.period);
            return due.then_some(AutoscaleInput {
                fleet,
                signals: None,
            });
        };
        let window = self.settings.defaults.window;
        let scope = fleet.scope(&pipeline, pods.trainers, window);
        cache.ask(&pipeline, scope, client);
        let snapshot = match cache.take(&pipeline, Instant::now()) {
            Latest::Fresh(snapshot) => snapshot,
            Latest::Pending => return None,
            Latest::Stale(age) => {
                tracing::warn!(%pipeline, ?age, "autoscaler signals stale; no decision this time");
                return None;
            }
        };
        match &snapshot.node_links {
            Ok(links) => fleet.node_link_bytes_per_second = links.clone(),
            Err(failure) => {
                self.degrade(&pipeline, failure);
                return None;
            }
        }
        lock(&self.degraded).remove(&pipeline);
        Some(AutoscaleInput {
            fleet,
            signals: snapshot.signals.clone().ok(),
        })
    }

    /// Decides for `dp` on what [`Self::observe`] read, and remembers the decision for the
    /// stabilization windows. No I/O.
    pub fn decide(
        &self,
        dp: &DataPipeline,
        input: &AutoscaleInput,
        now: Timestamp,
    ) -> ScaleDecision {
        let pipeline = PipelineKey::of(dp);
        let decision = lock(&self.state).step_pipeline(
            dp,
            &self.settings.defaults,
            &input.fleet,
            input.signals.as_ref(),
            now,
        );
        tracing::info!(
            %pipeline,
            from = decision.from,
            to = decision.replicas,
            moves = decision.move_pods.len(),
            reason = %decision.reason,
            "autoscaler decision"
        );
        self.metrics
            .record(&pipeline.namespace, &pipeline.name, &decision);
        decision
    }

    fn degrade(&self, pipeline: &PipelineKey, failure: &ReadFailure) {
        let hint = if failure.category == "nodes_forbidden" {
            " (the operator's ClusterRole needs get, list and watch on nodes)"
        } else {
            ""
        };
        let degradation = Degradation {
            reason: NODES_UNREADABLE,
            message: format!(
                "autoscaler made no decision: {}{hint}; decoders stay as they are",
                failure.message
            ),
        };
        tracing::warn!(%pipeline, message = %degradation.message, "autoscaler degraded");
        lock(&self.degraded).insert(pipeline.clone(), degradation);
    }

    /// Why the autoscaler could not decide for `dp` at its last try, if it could not.
    pub fn degraded(&self, dp: &DataPipeline) -> Option<Degradation> {
        lock(&self.degraded).get(&PipelineKey::of(dp)).cloned()
    }

    /// How often a pipeline is decided on.
    pub fn period(&self) -> Duration {
        self.settings.period
    }

    /// Nodes new decoders of `dp` must not land on, from the latest decision.
    pub fn avoid_nodes(&self, dp: &DataPipeline) -> Vec<String> {
        lock(&self.state).avoid_nodes(&PipelineKey::of(dp))
    }

    pub fn forget(&self, dp: &DataPipeline) {
        let pipeline = PipelineKey::of(dp);
        lock(&self.state).forget(&pipeline);
        if let Some(cache) = &self.cache {
            cache.forget(&pipeline);
        }
        lock(&self.degraded).remove(&pipeline);
        self.metrics.forget(&pipeline.namespace, &pipeline.name);
    }
}

/// A pipeline's pods as the controller observed them, with the trainers' declared world size.
#[derive(Clone, Copy, Debug)]
pub struct FleetPods<'a> {
    pub decoders: &'a [Pod],
    pub trainers: &'a [Pod],
    pub world_size: u32,
}

/// The fleet as it is: the pods, the nodes they run on, and the count in effect.
fn observe_fleet(dp: &DataPipeline, pods: &FleetPods<'_>) -> DecoderFleet {
    let in_effect = dp.status.as_ref().map_or(0, |s| s.decoders.desired);
    // The CRD's status counts are i32; the autoscaler counts in u32.
    DecoderFleet::observe(
        u32::try_from(in_effect).unwrap_or(0),
        pods.decoders,
        pods.trainers,
        pods.world_size,
    )
}

/// The map holds plain data, so a panic elsewhere cannot leave it half-written.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
