//! The autoscaler's part of a reconcile: ask the signal cache for the pipeline (never waiting
//! on Prometheus or the node list, which a background task reads), decide on a fresh snapshot,
//! and tell the sidecars their local-decode share. What to decide, and what to remember between
//! decisions, is `crate::autoscale`'s.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::reflector::ObjectRef;

use super::desired::Observed;
use super::local_share;
use super::trainers;
use crate::api::DataPipeline;
use crate::api::v1alpha1::AutoscalingMode;
use crate::autoscale::cache::{Latest, PipelineRef, ReadFailure, SignalCache};
use crate::autoscale::metrics::AutoscalerMetrics;
use crate::autoscale::prometheus::SignalError;
use crate::autoscale::{
    Autoscaler, AutoscalerSettings, DecoderFleet, ScaleDecision, Signals, pipeline_key,
};

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
    degraded: Mutex<BTreeMap<PipelineRef, Degradation>>,
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
            .map(|(namespace, name)| ObjectRef::new(&name).within(&namespace))
            .boxed()
    }

    /// A decision for `dp` when there is something new to decide on (`None` otherwise: the
    /// last one stands). With Prometheus, that is a fresh snapshot from the background read;
    /// without, once per period. Prometheus being unreachable is a decision too: keep the
    /// size, `MetricsUnavailable`. Never waits on Prometheus or the node list.
    pub async fn decide(
        &self,
        client: &Client,
        dp: &DataPipeline,
        observed: &Observed,
        now: Timestamp,
    ) -> Option<ScaleDecision> {
        let key = pipeline_key(dp);
        let pipeline: PipelineRef = (
            dp.metadata.namespace.clone().unwrap_or_default(),
            dp.metadata.name.clone().unwrap_or_default(),
        );
        let mut fleet = observe_fleet(dp, observed);
        let signals: Option<Signals> = match &self.cache {
            None => {
                if !lock(&self.state).due(&key, now, self.settings.period) {
                    return None;
                }
                None
            }
            Some(cache) => {
                let scope = fleet.scope(
                    &pipeline.0,
                    &pipeline.1,
                    &observed.trainers,
                    self.settings.defaults.window,
                );
                cache.ask(&pipeline, scope, client);
                let snapshot = match cache.take(&pipeline, Instant::now()) {
                    Latest::Fresh(snapshot) => snapshot,
                    Latest::Pending => return None,
                    Latest::Stale(age) => {
                        tracing::warn!(pipeline = %key, ?age, "autoscaler signals stale; no decision this time");
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
                snapshot.signals.clone().ok()
            }
        };
        lock(&self.degraded).remove(&pipeline);
        let decision = lock(&self.state).step_pipeline(
            dp,
            &self.settings.defaults,
            &fleet,
            signals.as_ref(),
            now,
        );
        tracing::info!(
            pipeline = %key,
            from = decision.from,
            to = decision.replicas,
            moves = decision.move_pods.len(),
            reason = %decision.reason,
            "autoscaler decision"
        );
        let (namespace, name) = &pipeline;
        self.metrics.record(namespace, name, &decision);
        // In recommend mode the decision is recorded, never acted on.
        if dp.spec.autoscaling.mode == AutoscalingMode::Auto {
            local_share::tell(
                client,
                namespace,
                &observed.trainers,
                decision.local_decode_share,
            )
            .await;
        }
        Some(decision)
    }

    fn degrade(&self, pipeline: &PipelineRef, failure: &ReadFailure) {
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
        tracing::warn!(pipeline = %pipeline.1, namespace = %pipeline.0, message = %degradation.message, "autoscaler degraded");
        lock(&self.degraded).insert(pipeline.clone(), degradation);
    }

    /// Why the autoscaler could not decide for `dp` at its last try, if it could not.
    pub fn degraded(&self, dp: &DataPipeline) -> Option<Degradation> {
        let pipeline = (
            dp.metadata.namespace.clone().unwrap_or_default(),
            dp.metadata.name.clone().unwrap_or_default(),
        );
        lock(&self.degraded).get(&pipeline).cloned()
    }

    /// How often a pipeline is decided on.
    pub fn period(&self) -> std::time::Duration {
        self.settings.period
    }

    /// Nodes new decoders of `dp` must not land on, from the latest decision.
    pub fn avoid_nodes(&self, dp: &DataPipeline) -> Vec<String> {
        lock(&self.state).avoid_nodes(&pipeline_key(dp))
    }

    pub fn forget(&self, dp: &DataPipeline) {
        let namespace = dp.metadata.namespace.clone().unwrap_or_default();
        let name = dp.metadata.name.clone().unwrap_or_default();
        lock(&self.state).forget(&pipeline_key(dp));
        let pipeline = (namespace, name);
        if let Some(cache) = &self.cache {
            cache.forget(&pipeline);
        }
        lock(&self.degraded).remove(&pipeline);
        self.metrics.forget(&pipeline.0, &pipeline.1);
    }
}

/// The fleet as it is: the pods, the nodes they run on, and the count in effect.
fn observe_fleet(dp: &DataPipeline, observed: &Observed) -> DecoderFleet {
    let trainer_status = trainers::trainer_status(&observed.trainers);
    let world_size = trainer_status.world_size.max(trainer_status.pods);
    let in_effect = dp.status.as_ref().map_or(0, |s| s.decoders.desired);
    // The CRD's status counts are i32; the autoscaler counts in u32.
    let count = |n: i32| u32::try_from(n).unwrap_or(0);
    DecoderFleet::observe(
        count(in_effect),
        &observed.decoders,
        &observed.trainers,
        count(world_size),
    )
}

/// The map holds plain data, so a panic elsewhere cannot leave it half-written.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
