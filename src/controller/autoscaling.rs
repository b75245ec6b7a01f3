//! The autoscaler inside a reconcile: once per period and pipeline, read the signals, decide,
//! and remember what placement the decision asked for until the next one.

use std::collections::BTreeMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ListParams};

use super::Error;
use super::local_share;
use super::reconcile::Observed;
use super::trainers;
use crate::api::DataPipeline;
use crate::api::v1alpha1::AutoscalingMode;
use crate::autoscale::metrics::AutoscalerMetrics;
use crate::autoscale::prometheus::{PrometheusSignals, SignalError};
use crate::autoscale::{Autoscaler, AutoscalerSettings, DecoderFleet, ScaleDecision, pipeline_key};

/// The autoscaler the controller shares across reconciles.
pub struct AutoscalerHandle {
    settings: AutoscalerSettings,
    reader: Option<PrometheusSignals>,
    state: Mutex<Autoscaler>,
    /// Per pipeline, the nodes the last decision keeps new decoders off.
    avoid: Mutex<BTreeMap<String, Vec<String>>>,
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
            avoid: Mutex::new(BTreeMap::new()),
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
        let due = lock(&self.state).due(&key, now, self.settings.period);
        if !due {
            return Ok(None);
        }
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
        let current = dp.status.as_ref().map_or(0, |s| s.decoders.desired);
        let fleet = DecoderFleet::observe(
            current,
            &observed.decoders,
            &observed.trainers,
            world_size,
            &nodes,
        );
        let namespace = dp.metadata.namespace.clone().unwrap_or_default();
        let name = dp.metadata.name.clone().unwrap_or_default();
        let scope = fleet.scope(
            &namespace,
            &name,
            &observed.trainers,
            self.settings.defaults.window,
        );
        let signals = match &self.reader {
            Some(reader) => match reader.read(&scope).await {
                Ok(signals) => Some(signals),
                Err(e) => {
                    tracing::warn!(pipeline = %key, error = %e, category = e.category(), "autoscaler signals unavailable");
                    self.metrics.signal_error(e.category());
                    None
                }
            },
            None => None,
        };
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
        lock(&self.avoid).insert(key, decision.avoid_nodes.clone());
        Ok(Some(decision))
    }

    /// How often a pipeline is decided on.
    pub fn period(&self) -> std::time::Duration {
        self.settings.period
    }

    /// Nodes new decoders of `dp` must not land on, from the latest decision.
    pub fn avoid_nodes(&self, dp: &DataPipeline) -> Vec<String> {
        lock(&self.avoid)
            .get(&pipeline_key(dp))
            .cloned()
            .unwrap_or_default()
    }

    pub fn forget(&self, dp: &DataPipeline) {
        let key = pipeline_key(dp);
        lock(&self.state).forget(&key);
        lock(&self.avoid).remove(&key);
        self.metrics.forget(
            dp.metadata.namespace.as_deref().unwrap_or_default(),
            dp.metadata.name.as_deref().unwrap_or_default(),
        );
    }
}

/// The maps hold plain data, so a panic elsewhere cannot leave them half-written.
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Keeps a new decoder off `avoid` nodes (their NIC is past the limit). Added to each new pod,
/// not to the template, so that a change of the list never rolls healthy decoders.
pub fn keep_off(pod: &mut Pod, avoid: &[String]) {
    if avoid.is_empty() {
        return;
    }
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    let term = serde_json::json!({
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": avoid}]
    });
    let affinity = spec.affinity.get_or_insert_with(Default::default);
    let node = affinity.node_affinity.get_or_insert_with(Default::default);
    let required = node
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(Default::default);
    let Ok(term) = serde_json::from_value(term) else {
        return;
    };
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(term);
    } else {
        // Terms are ORed; the expression must hold in each of them.
        for existing in &mut required.node_selector_terms {
            let extra: k8s_openapi::api::core::v1::NodeSelectorTerm = term.clone();
            existing
                .match_expressions
                .get_or_insert_with(Vec::new)
                .extend(extra.match_expressions.unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "d"},
            "spec": {"containers": [{"name": "c"}]}
        }))
        .expect("pod")
    }

    #[test]
    fn new_decoders_keep_off_hot_nodes() {
        let mut p = pod();
        keep_off(&mut p, &["cpu-0".to_string(), "cpu-3".to_string()]);
        let terms = p
            .spec
            .unwrap()
            .affinity
            .unwrap()
            .node_affinity
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .unwrap()
            .node_selector_terms;
        assert_eq!(terms.len(), 1);
        let expr = &terms[0].match_expressions.as_ref().unwrap()[0];
        assert_eq!(expr.key, "kubernetes.io/hostname");
        assert_eq!(expr.operator, "NotIn");
        assert_eq!(
            expr.values.as_deref(),
            Some(&["cpu-0".to_string(), "cpu-3".to_string()][..])
        );
    }

    #[test]
    fn nothing_to_avoid_leaves_the_pod_alone() {
        let mut p = pod();
        keep_off(&mut p, &[]);
        assert!(p.spec.unwrap().affinity.is_none());
    }
}
