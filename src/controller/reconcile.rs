//! One reconcile: observe → validate → build → apply → status.

use futures::{StreamExt, TryStreamExt, stream};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};

use super::build::{config_map, decoder_pod, network_policy, service, sidecar_rbac};
use super::{
    ChildStores, Context, Error, FIELD_MANAGER, apply, autoscaling, fleet, status, trainers,
    validate,
};
use crate::api::v1alpha1::AutoscalingMode;
use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_DECODER};

/// The pods of one pipeline.
pub struct Observed {
    pub decoders: Vec<Pod>,
    pub trainers: Vec<Pod>,
}

/// The pipeline's pods from the controller's caches, with its own recent writes laid over them
/// (see [`super::expectations`]); listed from the API server while the caches fill.
async fn observe(
    ctx: &Context,
    pods: &Api<Pod>,
    namespace: &str,
    name: &str,
) -> Result<Observed, Error> {
    let key = (namespace.to_string(), name.to_string());
    if let Some(cached) = ctx.children().filter(ChildStores::pods_ready) {
        let decoders = ChildStores::pods_of(&cached.decoders, namespace, name);
        return Ok(Observed {
            decoders: ctx.pod_writes.overlay(&key, decoders),
            trainers: ChildStores::pods_of(&cached.trainers, namespace, name),
        });
    }
    let list = pods
        .list(&ListParams::default().labels(&format!("{LABEL_PIPELINE}={name}")))
        .await
        .map_err(|source| Error::Kube {
            verb: "list",
            kind: "Pod",
            namespace: namespace.to_string(),
            name: name.to_string(),
            source,
        })?;
    let (decoders, trainers) = list
        .items
        .into_iter()
        .partition(|p| p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_DECODER));
    Ok(Observed {
        decoders: ctx.pod_writes.overlay(&key, decoders),
        trainers,
    })
}

/// Pod writes one reconcile keeps in flight: fast scale-up without a burst that trips API
/// priority and fairness.
const POD_WRITES_IN_FLIGHT: usize = 16;

/// Five lowercase alphanumerics, like the suffixes of generated names.
fn pod_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = RandomState::new().hash_one(Instant::now());
    (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

fn scale_reason(dp: &DataPipeline) -> String {
    match dp.spec.autoscaling.mode {
        AutoscalingMode::Off => "autoscaling.mode is fixed: autoscaling.replicas".to_string(),
        AutoscalingMode::Recommend => {
            "autoscaling.mode is recommend: decoders.minReplicas".to_string()
        }
        AutoscalingMode::Auto => "no autoscaler signals yet: decoders.minReplicas".to_string(),
    }
}

pub async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&dp, &ctx).await;
    ctx.metrics.reconciled(started.elapsed().as_secs_f64());
    result
}

async fn reconcile_inner(dp: &DataPipeline, ctx: &Context) -> Result<Action, Error> {
    let name = dp.name_any();
    let namespace = dp
        .namespace()
        .ok_or_else(|| Error::MissingNamespace(name.clone()))?;
    if dp.meta().deletion_timestamp.is_some() {
        // Children go with the pipeline through their owner references.
        ctx.metrics.forget_pipeline(&namespace, &name);
        if let Some(autoscaler) = &ctx.autoscaler {
            autoscaler.forget(dp);
        }
        return Ok(Action::await_change());
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let now = Timestamp::now();

    // observe
    let observed = observe(ctx, &pods, &namespace, &name).await?;

    // validate
    let problems = validate::validate(&dp.spec, &ctx.defaults);

    // build
    let build_err = |kind| {
        move |source| Error::Build {
            kind,
            name: name.clone(),
            source,
        }
    };
    let config = config_map::config_map(dp).map_err(build_err("ConfigMap"))?;
    let svc = service::decoder_service(dp);
    let policy = network_policy::network_policy(dp);
    let role = sidecar_rbac::sidecar_role(dp);
    let binding = sidecar_rbac::sidecar_role_binding(dp);
    // autoscale: a decision once per period; between them the count in effect stands.
    let decision = match &ctx.autoscaler {
        Some(a) if dp.spec.autoscaling.mode != AutoscalingMode::Off => {
            a.decide(&ctx.client, dp, &observed, now).await?
        }
        _ => None,
    };
    let recommended = match &decision {
        Some(d) => Some(i32::try_from(d.recommended).unwrap_or(i32::MAX)),
        None if ctx.autoscaler.is_some() => dp.status.as_ref().map(|s| s.decoders.desired),
        None => None,
    };
    let desired = fleet::desired_replicas(&dp.spec, recommended);
    let mut plan = if problems.is_empty() {
        let spec = decoder_pod::decoder_pod_spec(dp, &ctx.defaults);
        fleet::plan(
            &observed.decoders,
            usize::try_from(desired).unwrap_or(0),
            &decoder_pod::template_hash(&spec),
            u32::try_from(dp.spec.decoders.drain_seconds).unwrap_or(0),
            now,
        )
    } else {
        fleet::FleetPlan::default()
    };

    // Decoders pushing a node's NIC past the limit drain and are replaced elsewhere.
    if let Some(d) = decision.as_ref().filter(|_| problems.is_empty()) {
        for pod in &d.move_pods {
            if !plan.drain.contains(pod) && !plan.delete.contains(pod) {
                plan.drain.push(pod.clone());
                plan.create += 1;
            }
        }
    }

    // apply
    let client = &ctx.client;
    // The watches' copies: children already as built are not applied again.
    let cached = ctx.children();
    let cached = cached.as_ref();
    let applied = futures::try_join!(
        apply::apply_child(
            client,
            &config,
            cached.and_then(|c| ChildStores::live(&c.config_maps, &config)),
            FIELD_MANAGER
        ),
        apply::apply_child(
            client,
            &svc,
            cached.and_then(|c| ChildStores::live(&c.services, &svc)),
            FIELD_MANAGER
        ),
        apply::apply_child(
            client,
            &policy,
            cached.and_then(|c| ChildStores::live(&c.network_policies, &policy)),
            FIELD_MANAGER
        ),
        apply::apply_child(
            client,
            &role,
            cached.and_then(|c| ChildStores::live(&c.roles, &role)),
            FIELD_MANAGER
        ),
        apply::apply_child(
            client,
            &binding,
            cached.and_then(|c| ChildStores::live(&c.role_bindings, &binding)),
            FIELD_MANAGER
        ),
    )?;
    let (a, b, c, d, e) = applied;
    ctx.metrics.children_applied(&[a, b, c, d, e]);
    let avoid = ctx
        .autoscaler
        .as_ref()
        .map(|a| a.avoid_nodes(dp))
        .unwrap_or_default();
    let new_pods: Vec<Pod> = (0..plan.create)
        .map(|_| {
            let mut pod = decoder_pod::decoder_pod(dp, &pod_suffix(), &ctx.defaults);
            autoscaling::keep_off(&mut pod, &avoid);
            pod
        })
        .collect();
    // Futures are made eagerly (Vecs, not lazy maps) so the reconcile future stays Send.
    let limit = POD_WRITES_IN_FLIGHT;
    let mut creates = Vec::new();
    for pod in &new_pods {
        creates.push(apply::apply(client, pod, FIELD_MANAGER));
    }
    let mut drains = Vec::new();
    for name in &plan.drain {
        drains.push(apply::drain(&pods, name, FIELD_MANAGER, now));
    }
    let mut deletes = Vec::new();
    for pod in &plan.delete {
        let pods = &pods;
        deletes.push(async move { apply::delete(pods, pod).await.map(|()| pod.clone()) });
    }
    // Each write is remembered as it lands, so one failed write forgets none of the others.
    let key = (namespace.clone(), dp.name_any());
    let remember = |written: Vec<Pod>, deleted: Vec<String>| {
        ctx.pod_writes.record(key.clone(), written, deleted);
    };
    futures::try_join!(
        stream::iter(creates)
            .buffer_unordered(limit)
            .inspect_ok(|pod| remember(vec![pod.clone()], vec![]))
            .try_collect::<Vec<Pod>>(),
        stream::iter(drains)
            .buffer_unordered(limit)
            .inspect_ok(|pod| remember(pod.iter().cloned().collect(), vec![]))
            .try_collect::<Vec<Option<Pod>>>(),
        stream::iter(deletes)
            .buffer_unordered(limit)
            .inspect_ok(|name| remember(vec![], vec![name.clone()]))
            .try_collect::<Vec<String>>(),
    )?;
    let reference = dp.object_ref(&());
    if plan.create > 0 || !plan.drain.is_empty() || !plan.delete.is_empty() {
        tracing::info!(
            pipeline = %dp.name_any(),
            %namespace,
            desired,
            created = plan.create,
            draining = plan.drain.len(),
            deleted = plan.delete.len(),
            failed = plan.failed,
            "decoder fleet changed"
        );
    }
    if plan.create > 0 || !plan.drain.is_empty() || plan.failed > 0 {
        let note = format!(
            "decoders: {desired} desired; created {}, draining {}, replaced {} failed",
            plan.create,
            plan.drain.len(),
            plan.failed
        );
        publish(ctx, &reference, "ScaledDecoders", &note, EventType::Normal).await;
    }
    if let Some(d) = decision.as_ref().filter(|d| d.scales()) {
        publish(
            ctx,
            &reference,
            "AutoscalerDecision",
            &d.reason,
            EventType::Normal,
        )
        .await;
    }

    // status: count what the fleet is after this reconcile's changes settle
    let mut fleet_status = fleet::fleet_status(&observed.decoders, desired);
    let drained = i32::try_from(plan.drain.len()).unwrap_or(0);
    fleet_status.draining += drained;
    fleet_status.ready = (fleet_status.ready - drained).max(0);
    let obs = status::Observation {
        fleet: fleet_status,
        trainers: trainers::trainer_status(&observed.trainers),
        problems,
        failed_replaced: plan.failed,
        scale_reason: decision
            .as_ref()
            .map_or_else(|| scale_reason(dp), |d| d.reason.clone()),
        autoscale: decision.as_ref(),
    };
    let new_status = status::desired_status(dp, obs, now);
    ctx.metrics.fleet(
        &namespace,
        &dp.name_any(),
        new_status.decoders.desired,
        new_status.decoders.ready,
        new_status.decoders.draining,
    );
    let was_ready = ready_status(dp.status.as_ref());
    let is_ready = ready_status(Some(&new_status));
    let api: Api<DataPipeline> = Api::namespaced(ctx.client.clone(), &namespace);
    status::write(&api, dp, &new_status, FIELD_MANAGER).await?;
    if was_ready != is_ready {
        let (reason, kind) = if is_ready.as_deref() == Some("True") {
            ("Ready", EventType::Normal)
        } else {
            ("NotReady", EventType::Warning)
        };
        let message = new_status
            .conditions
            .iter()
            .find(|c| c.type_ == status::READY)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        publish(ctx, &reference, reason, &message, kind).await;
    }
    // An autoscaled pipeline is looked at again when its next decision is due.
    let next_look = match &ctx.autoscaler {
        Some(a) if dp.spec.autoscaling.mode != AutoscalingMode::Off => a.period().min(ctx.resync),
        _ => ctx.resync,
    };
    Ok(match plan.requeue_after {
        Some(after) => Action::requeue(
            after
                .max(std::time::Duration::from_millis(200))
                .min(next_look),
        ),
        None => Action::requeue(next_look),
    })
}

fn ready_status(status: Option<&crate::api::DataPipelineStatus>) -> Option<String> {
    status?
        .conditions
        .iter()
        .find(|c| c.type_ == status::READY)
        .map(|c| c.status.clone())
}

async fn publish(
    ctx: &Context,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    reason: &str,
    note: &str,
    type_: EventType,
) {
    let event = Event {
        type_,
        reason: reason.to_string(),
        note: Some(note.chars().take(1024).collect()),
        action: "Reconcile".to_string(),
        secondary: None,
    };
    // A Recorder folds an Event into an earlier one with the same reason and object (an
    // events.k8s.io series) and keeps the earlier note: "no trainers: 1 decoders" would stand
    // for every later decision. Events come on transitions only, so each gets its own.
    let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
    if let Err(e) = recorder.publish(&event, reference).await {
        tracing::debug!(error = %e, "event not published");
    }
}
