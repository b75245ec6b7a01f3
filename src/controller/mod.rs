//! The DataPipeline controller: watches pipelines and the objects they own, and reconciles each
//! pipeline through [`reconcile::reconcile`].

pub mod apply;

pub mod desired;
mod error;
pub mod expectations;
pub mod fleet;
pub mod index;
pub mod local_share;
pub mod observe;
pub mod reconcile;
pub mod report;
pub mod retry;
pub mod status;
pub mod trainers;
pub mod validate;

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub use error::Error;
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_DECODER, ROLE_TRAINER};
use crate::build::BuildDefaults;
use crate::build::index_job::LABEL_INDEX_OF;
use crate::telemetry::Metrics;

/// The one field manager for everything the operator writes.
pub const FIELD_MANAGER: &str = "stoker-operator";

/// Reconciles in flight at once. Unbounded, a restart sends every pipeline's reads and writes to
/// the API server together (500 pipelines: reconcile p50 0.9 s on two cores), and each waits
/// behind all the others; the rest wait in the controller's queue instead.
const MAX_CONCURRENT_RECONCILES: u16 = 16;

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
    pub autoscaler: Option<crate::signal_source::AutoscalerHandle>,
    /// What the installation's CA Secret belongs to (see [`crate::installation`]).
    pub owner: Option<OwnerReference>,
    /// The running controller's caches of the children; `None` outside [`run`].
    children: RwLock<Option<ChildStores>>,
    /// Pod writes the pod caches may not show yet.
    pub pod_writes: expectations::PodExpectations,
    /// When each failing pipeline is tried again.
    pub retries: retry::RetryBackoff,
    /// Publishes reconcile failures; one Recorder for all of them, so that a failure that
    /// repeats becomes one Event series with a count rather than an Event per retry.
    pub failure_events: Recorder,
    /// Sidecar token Secrets known to exist (by owner UID and name), so each is created once
    /// per process rather than tried on every reconcile.
    pub sidecar_tokens: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

/// What the controller's watches last saw of the pipelines' pods and of the children it applies:
/// a reconcile reads its pods from here rather than listing them, and a child that already is
/// what the reconcile builds is not applied again (see [`apply::apply_child`]).
#[derive(Clone)]
pub struct ChildStores {
    pub decoders: Store<Pod>,
    pub trainers: Store<Pod>,
    pub services: Store<Service>,
    pub network_policies: Store<NetworkPolicy>,
    pub roles: Store<Role>,
    pub role_bindings: Store<RoleBinding>,
    pub service_accounts: Store<ServiceAccount>,
    pub jobs: Store<Job>,
    /// The index Jobs' pods (label `stoker.dev/index-of`): their termination messages.
    pub index_pods: Store<Pod>,
    /// The sidecars' `SourceUnavailable` Events on pipelines.
    pub outage_events: Store<CoreEvent>,
}

impl ChildStores {
    /// The cached copy of `obj`, by namespace and name.
    pub fn live<K>(store: &Store<K>, obj: &K) -> Option<Arc<K>>
    where
        K: kube::Resource<DynamicType = ()> + Clone,
    {
        store.get(&ObjectRef::from_obj(obj))
    }

    /// Whether `store` holds a complete first list.
    pub fn ready<K>(store: &Store<K>) -> bool
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        use futures::FutureExt;
        store
            .wait_until_ready()
            .now_or_never()
            .is_some_and(|r| r.is_ok())
    }

    /// Whether both pod caches hold a complete first list: until then a reconcile lists.
    pub fn pods_ready(&self) -> bool {
        Self::ready(&self.decoders) && Self::ready(&self.trainers)
    }

    /// The cached objects an owner (by UID) owns.
    pub fn owned<K>(store: &Store<K>, owner_uid: &str) -> Vec<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        store
            .state_filter(|o| owned_by(o, owner_uid))
            .into_iter()
            .map(Arc::unwrap_or_clone)
            .collect()
    }

    /// One pipeline's cached pods.
    pub fn pods_of(store: &Store<Pod>, namespace: &str, pipeline: &str) -> Vec<Pod> {
        store
            .state_filter(|p| {
                p.namespace().as_deref() == Some(namespace)
                    && p.labels().get(LABEL_PIPELINE).map(String::as_str) == Some(pipeline)
            })
            .into_iter()
            .map(Arc::unwrap_or_clone)
            .collect()
    }
}

/// Whether `obj` names `owner_uid` among its owners.
pub fn owned_by(obj: &impl Resource, owner_uid: &str) -> bool {
    !owner_uid.is_empty()
        && obj
            .meta()
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.uid == owner_uid)
}

impl Context {
    pub fn new(client: Client, defaults: BuildDefaults, metrics: Arc<Metrics>) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            failure_events: Recorder::new(client.clone(), reporter.clone()),
            retries: retry::RetryBackoff::default(),
            client,
            defaults,
            metrics,
            reporter,
            resync: Duration::from_secs(300),
            autoscaler: None,
            owner: None,
            children: RwLock::new(None),
            pod_writes: expectations::PodExpectations::default(),
            sidecar_tokens: std::sync::Mutex::default(),
        }
    }

    /// The running controller's child caches, `None` before it runs.
    pub fn children(&self) -> Option<ChildStores> {
        self.children
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_children(&self, stores: Option<ChildStores>) {
        *self
            .children
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = stores;
    }

    pub fn with_autoscaler(
        mut self,
        autoscaler: Option<crate::signal_source::AutoscalerHandle>,
    ) -> Self {
        self.autoscaler = autoscaler;
        self
    }

    pub fn with_owner(mut self, owner: Option<OwnerReference>) -> Self {
        self.owner = owner;
        self
    }
}

/// A failed reconcile is retried after the pipeline's next backoff delay (see [`retry`]); the
/// reconcile itself already put the failure in `Degraded` and an Event.
fn error_policy(dp: Arc<DataPipeline>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_error(error.category());
    let key = crate::api::PipelineKey::of(&dp);
    let delay = ctx
        .retries
        .failed(&key, dp.meta().generation, Instant::now());
    tracing::warn!(error = %error, category = error.category(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Objects of one kind, in `ns` or every namespace.
fn scoped<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A cache of one kind for the reconcile, and its changes as triggers.
fn cached<K>(
    api: Api<K>,
    config: &watcher::Config,
) -> (
    Store<K>,
    impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    // managedFields are much of an object's bytes and nothing here reads them.
    let stream = watcher(api, config.clone())
        .default_backoff()
        .modify(|o| o.managed_fields_mut().clear())
        .reflect(writer)
        .touched_objects();
    (store, stream)
}

/// The pipeline a pod names in its `label`: what a change of the pod reconciles.
fn pipeline_in(label: &'static str) -> impl Fn(Pod) -> Option<ObjectRef<DataPipeline>> {
    move |pod: Pod| {
        let ns = pod.namespace()?;
        let name = pod.labels().get(label)?;
        Some(ObjectRef::<DataPipeline>::new(name).within(&ns))
    }
}

/// Runs the controller until `shutdown`; `namespace` limits it to one namespace.
pub async fn run(ctx: Arc<Context>, namespace: Option<String>, shutdown: CancellationToken) {
    let client = ctx.client.clone();
    let ns = namespace.as_deref();
    let managed = watcher::Config::default().labels("app.kubernetes.io/managed-by=stoker-operator");
    let decoder_pods = watcher::Config::default().labels(&format!("{LABEL_ROLE}={ROLE_DECODER}"));
    let trainer_pods = watcher::Config::default().labels(&format!("{LABEL_ROLE}={ROLE_TRAINER}"));
    let (decoders, decoder_changes) = cached(scoped::<Pod>(&client, ns), &decoder_pods);
    let (trainers, trainer_changes) = cached(scoped::<Pod>(&client, ns), &trainer_pods);
    let (services, service_changes) = cached(scoped::<Service>(&client, ns), &managed);
    let (network_policies, network_policy_changes) =
        cached(scoped::<NetworkPolicy>(&client, ns), &managed);
    let (roles, role_changes) = cached(scoped::<Role>(&client, ns), &managed);
    let (role_bindings, role_binding_changes) =
        cached(scoped::<RoleBinding>(&client, ns), &managed);
    let (service_accounts, service_account_changes) =
        cached(scoped::<ServiceAccount>(&client, ns), &managed);
    let (jobs, job_changes) = cached(scoped::<Job>(&client, ns), &managed);
    // A sidecar's SourceUnavailable Event on a pipeline: reconcile it, so the condition shows.
    let outage_events = watcher::Config::default().fields(&format!(
        "involvedObject.kind=DataPipeline,reason={}",
        status::SOURCE_UNAVAILABLE
    ));
    let (outage_events, outage_reports) = cached(scoped::<CoreEvent>(&client, ns), &outage_events);
    let index_pods = watcher::Config::default().labels(LABEL_INDEX_OF);
    let (index_pods, index_pod_changes) = cached(scoped::<Pod>(&client, ns), &index_pods);
    ctx.pod_writes.clear();
    ctx.set_children(Some(ChildStores {
        decoders,
        trainers,
        services,
        network_policies,
        roles,
        role_bindings,
        service_accounts,
        jobs,
        index_pods,
        outage_events,
    }));
    // A new snapshot of a pipeline's autoscaler signals: decide on it now.
    let signal_reads = match &ctx.autoscaler {
        Some(autoscaler) => autoscaler.reconcile_triggers(),
        None => futures::stream::pending().boxed(),
    };
    let running = ctx.clone();
    Controller::new(
        scoped::<DataPipeline>(&client, ns),
        watcher::Config::default(),
    )
    .with_config(kube::runtime::Config::default().concurrency(MAX_CONCURRENT_RECONCILES))
    .owns_stream(decoder_changes)
    .owns_stream(service_changes)
    .owns_stream(network_policy_changes)
    .owns_stream(role_changes)
    .owns_stream(role_binding_changes)
    .owns_stream(service_account_changes)
    .owns_stream(job_changes)
    // Trainer pods are not owned, but their count and injection show in the status.
    .watches_stream(trainer_changes, pipeline_in(LABEL_PIPELINE))
    // An index pod's end (its summary) shows in the status.
    .watches_stream(index_pod_changes, pipeline_in(LABEL_INDEX_OF))
    .watches_stream(outage_reports, |event: CoreEvent| {
        let about = event.involved_object;
        Some(ObjectRef::<DataPipeline>::new(&about.name?).within(&about.namespace?))
    })
    .reconcile_on(signal_reads)
    .graceful_shutdown_on(shutdown.cancelled_owned())
    .run(reconcile::reconcile, error_policy, ctx)
    .for_each(|_| futures::future::ready(()))
    .await;
    // A later run (a regained lease) starts from fresh caches, never from these stale ones.
    running.set_children(None);
}
