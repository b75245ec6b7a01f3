//! The DataPipeline controller: watches pipelines and the objects they own, and reconciles each
//! pipeline through [`reconcile::reconcile`].

pub mod apply;
pub mod autoscaling;
pub mod build;
mod error;
pub mod fleet;
pub mod local_share;
pub mod reconcile;
pub mod status;
pub mod trainers;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

pub use error::Error;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_DECODER, ROLE_TRAINER};
use crate::telemetry::Metrics;
use build::BuildDefaults;

/// The one field manager for everything the operator writes.
pub const FIELD_MANAGER: &str = "stoker-operator";

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub defaults: BuildDefaults,
    pub metrics: Arc<Metrics>,
    /// Who publishes the Events (see `reconcile::publish` for why there is no shared Recorder).
    pub reporter: Reporter,
    /// How often a settled pipeline is looked at again.
    pub resync: Duration,
    /// `None`: no autoscaling; pipelines in `auto` mode run `decoders.minReplicas`.
    pub autoscaler: Option<autoscaling::AutoscalerHandle>,
}

impl Context {
    pub fn new(client: Client, defaults: BuildDefaults, metrics: Arc<Metrics>) -> Self {
        Self {
            client,
            defaults,
            metrics,
            reporter: Reporter {
                controller: FIELD_MANAGER.into(),
                instance: std::env::var("POD_NAME").ok(),
            },
            resync: Duration::from_secs(300),
            autoscaler: None,
        }
    }

    pub fn with_autoscaler(mut self, autoscaler: Option<autoscaling::AutoscalerHandle>) -> Self {
        self.autoscaler = autoscaler;
        self
    }
}

fn error_policy(_dp: Arc<DataPipeline>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_error(error.category());
    tracing::warn!(error = %error, category = error.category(), "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the controller until `shutdown`; `namespace` limits it to one namespace.
pub async fn run(ctx: Arc<Context>, namespace: Option<String>, shutdown: CancellationToken) {
    let client = ctx.client.clone();
    fn scoped<K>(client: &Client, ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let ns = namespace.as_deref();
    let managed = watcher::Config::default().labels("app.kubernetes.io/managed-by=stoker-operator");
    Controller::new(
        scoped::<DataPipeline>(&client, ns),
        watcher::Config::default(),
    )
    .owns(
        scoped::<Pod>(&client, ns),
        watcher::Config::default().labels(&format!("{LABEL_ROLE}={ROLE_DECODER}")),
    )
    .owns(scoped::<Service>(&client, ns), managed.clone())
    .owns(scoped::<ConfigMap>(&client, ns), managed.clone())
    .owns(scoped::<NetworkPolicy>(&client, ns), managed)
    // Trainer pods are not owned, but their count and injection show in the status.
    .watches(
        scoped::<Pod>(&client, ns),
        watcher::Config::default().labels(&format!("{LABEL_ROLE}={ROLE_TRAINER}")),
        |pod: Pod| {
            let ns = pod.namespace()?;
            pod.labels()
                .get(LABEL_PIPELINE)
                .map(|name| ObjectRef::<DataPipeline>::new(name).within(&ns))
        },
    )
    .graceful_shutdown_on(shutdown.cancelled_owned())
    .run(reconcile::reconcile, error_policy, ctx)
    .for_each(|_| futures::future::ready(()))
    .await;
}
