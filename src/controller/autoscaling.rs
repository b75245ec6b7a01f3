//! The autoscaler's I/O inside a reconcile: list the nodes, read the signals from Prometheus,
//! tell the sidecars their local-decode share. What to decide, and what to remember between
//! decisions, is `crate::autoscale`'s.

use std::sync::Mutex;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ListParams};

use super::Error;
use super::desired::Observed;
use super::local_share;
use super::trainers;
use crate::api::DataPipeline;
use crate::api::v1alpha1::AutoscalingMode;
use crate::autoscale::metrics::AutoscalerMetrics;
use crate::autoscale::prometheus::{PrometheusSignals, SignalError, SignalScope};
use crate::autoscale::{
    Autoscaler, AutoscalerSettings, DecoderFleet, ScaleDecision, Signals, pipeline_key,
};

/// The autoscaler the controller shares across reconciles.
pub struct AutoscalerHandle {
    settings: AutoscalerSettings,
    reader: Option<PrometheusSignals>,
    state: Mutex<Autoscaler>,
    metrics: AutoscalerMetrics,
}

impl AutoscalerHandle {
    pub fn new(
        settings: AutoscalerSettings,
        metrics: AutoscalerMetrics,
    ) -> Result<Self, SignalError> {
        Ok(Self {
            reader: settings.reader()?,
            settings,
            state: Mutex::new(Autoscaler::default()),
            metrics,
        })
    }

    /// A decision for `dp` when one is due (`None` between periods: the last one stands).
    /// Prometheus being unreachable is a decision too: keep the size, `MetricsUnavailable`.
    pub async fn decide(
        &self,
        client: &Client,
        dp: &DataPipeline,
        observed: &Observed,
        now: Timestamp,
    ) -> Result<Option<ScaleDecision>, Error> {
        let key = pipeline_key(dp);
        if !lock(&self.state).due(&key, now, self.settings.period) {
            return Ok(None);
        }
        let fleet = observe_fleet(client, dp, observed).await?;
        let namespace = dp.metadata.namespace.clone().unwrap_or_default();
        let name = dp.metadata.name.clone().unwrap_or_default();
        let scope = fleet.scope(
            &namespace,
            &name,
            &observed.trainers,
            self.settings.defaults.window,
        );
        let signals = self.read(&key, &scope).await;
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
        self.metrics.record(&namespace, &name, &decision);
        // In recommend mode the decision is recorded, never acted on.
        if dp.spec.autoscaling.mode == AutoscalingMode::Auto {
            local_share::tell(
                client,
                &namespace,
                &observed.trainers,
                decision.local_decode_share,
            )
            .await;
        }
        Ok(Some(decision))
    }

    /// The signals for `scope`; `None` (the size is kept) without a reader or an answer.
    async fn read(&self, key: &str, scope: &SignalScope) -> Option<Signals> {
        let reader = self.reader.as_ref()?;
        match reader.read(scope).await {
            Ok(signals) => Some(signals),
            Err(e) => {
                tracing::warn!(pipeline = %key, error = %e, category = e.category(), "autoscaler signals unavailable");
                self.metrics.signal_error(e.category());
                None
            }
        }
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
        lock(&self.state).forget(&pipeline_key(dp));
        self.metrics.forget(
            dp.metadata.namespace.as_deref().unwrap_or_default(),
            dp.metadata.name.as_deref().unwrap_or_default(),
        );
    }
}

/// The fleet as it is: the pods, the nodes they run on, and the count in effect.
async fn observe_fleet(
    client: &Client,
    dp: &DataPipeline,
    observed: &Observed,
) -> Result<DecoderFleet, Error> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| Error::Kube {
            verb: "list",
            kind: "Node",
            namespace: String::new(),
            name: String::new(),
            source,
        })?
        .items;
    let trainer_status = trainers::trainer_status(&observed.trainers);
    let world_size = trainer_status.world_size.max(trainer_status.pods);
    let in_effect = dp.status.as_ref().map_or(0, |s| s.decoders.desired);
    // The CRD's status counts are i32; the autoscaler counts in u32.
    let count = |n: i32| u32::try_from(n).unwrap_or(0);
    Ok(DecoderFleet::observe(
        count(in_effect),
        &observed.decoders,
        &observed.trainers,
        count(world_size),
        &nodes,
    ))
}

/// The map holds plain data, so a panic elsewhere cannot leave it half-written.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
