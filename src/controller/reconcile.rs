//! One reconcile, as a pipeline of named steps:
//! observe (caches) → decide (the autoscaler) → validate (a failure stops here, with a
//! condition) → [`desired`] (pure: every child as a typed value) → apply → report and status.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};

use super::desired::{DecoderChanges, Desired, Observed, Scale, desired};
use super::status::SOURCE_UNAVAILABLE;
use super::{
    ChildStores, Context, Error, FIELD_MANAGER, apply, certs, fleet, index, status, trainers,
    validate,
};
use crate::api::v1alpha1::{AutoscalingMode, DataPipelineStatus};
use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_DECODER};

/// A pipeline's namespace and name: how expectations and the autoscaler key it.
pub type PipelineKey = (String, String);

/// The namespace and name of a pipeline (the namespace empty if it has none).
pub fn key_of(dp: &DataPipeline) -> PipelineKey {
    (dp.namespace().unwrap_or_default(), dp.name_any())
}

pub async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = key_of(&dp);
    if let Some(wait) = ctx.retries.wait(&key, dp.meta().generation, Instant::now()) {
        return Ok(Action::requeue(wait));
    }
    let started = Instant::now();
    let result = reconcile_inner(&dp, &ctx).await;
    ctx.metrics.reconciled(started.elapsed().as_secs_f64());
    match &result {
        Ok(_) => ctx.retries.succeeded(&key),
        Err(error) => report_failure(&ctx, &dp, &key, error).await,
    }
    result
}

/// A failed reconcile shows where users look: `Degraded=True` with the error's category as
/// the reason and its message, and a Warning Event with the same reason.
async fn report_failure(ctx: &Context, dp: &DataPipeline, key: &PipelineKey, error: &Error) {
    let (reason, message) = (error.reason(), error.summary());
    if !key.0.is_empty() {
        let new_status = status::failed_status(dp, &reason, &message, Timestamp::now());
        let api: Api<DataPipeline> = Api::namespaced(ctx.client.clone(), &key.0);
        if let Err(e) = status::write(&api, dp, &new_status, FIELD_MANAGER).await {
            tracing::debug!(error = %e, "failure not written to status");
        }
    }
    let event = Event {
        type_: EventType::Warning,
        reason,
        note: Some(message.chars().take(1024).collect()),
        action: "Reconcile".to_string(),
        secondary: None,
    };
    if let Err(e) = ctx
        .failure_events
        .publish(&event, &dp.object_ref(&()))
        .await
    {
        tracing::debug!(error = %e, "event not published");
    }
}

async fn reconcile_inner(dp: &DataPipeline, ctx: &Context) -> Result<Action, Error> {
    let name = dp.name_any();
    let namespace = dp
        .namespace()
        .ok_or_else(|| Error::MissingNamespace(name.clone()))?;
    let key: PipelineKey = (namespace, name);
    if dp.meta().deletion_timestamp.is_some() {
        forget(ctx, dp, &key);
        return Ok(Action::await_change());
    }
    let now = Timestamp::now();
    let observed = observe(ctx, &key).await?;
    let scale = decide(ctx, dp, &observed, now).await?;
    let problems = validate::validate(&dp.spec, &ctx.defaults);
    if !problems.is_empty() {
        let status = invalid_status(dp, &observed, &scale, problems, now);
        write_status(ctx, dp, &key, &status).await?;
        return Ok(Action::requeue(ctx.resync));
    }
    let desired =
        desired(dp, &observed, &scale, &ctx.defaults, now).map_err(|source| Error::LoaderArgs {
            name: key.1.clone(),
            source,
        })?;
    // Before the decoders that mount it: a pod whose Secret is missing waits for it.
    certs::ensure_pipeline_secret(&ctx.client, dp, ctx.owner.as_ref()).await?;
    apply::apply_desired(ctx, &key, &desired, now).await?;
    report(ctx, dp, &key, &desired.decoders, &scale).await;
    let mut status = settled_status(dp, &observed, &desired, &scale, now);
    if let Some(job) = &desired.index_job {
        let observed_index = index::observe(ctx, dp, job).await?;
        index::report(dp, &mut status, observed_index, now);
    }
    autoscaler_degraded(ctx, dp, &mut status, now).await;
    write_status(ctx, dp, &key, &status).await?;
    Ok(next_look(ctx, dp, &observed, &desired))
}

/// A deleted pipeline: its children go with it through their owner references.
fn forget(ctx: &Context, dp: &DataPipeline, (namespace, name): &PipelineKey) {
    ctx.metrics.forget_pipeline(namespace, name);
    if let Some(autoscaler) = &ctx.autoscaler {
        autoscaler.forget(dp);
    }
}

/// The pipeline's pods from the controller's caches, with its own recent writes laid over them
/// (see [`super::expectations`]); listed from the API server while the caches fill.
async fn observe(ctx: &Context, key: &PipelineKey) -> Result<Observed, Error> {
    let (namespace, name) = key;
    let source_outage = source_outage(ctx, key).await;
    if let Some(cached) = ctx.children().filter(ChildStores::pods_ready) {
        let decoders = ChildStores::pods_of(&cached.decoders, namespace, name);
        return Ok(Observed {
            decoders: ctx.pod_writes.overlay(key, decoders),
            trainers: ChildStores::pods_of(&cached.trainers, namespace, name),
            source_outage,
        });
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let list = pods
        .list(&ListParams::default().labels(&format!("{LABEL_PIPELINE}={name}")))
        .await
        .map_err(|source| Error::Kube {
            verb: "list",
            kind: "Pod",
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        })?;
    let (decoders, trainers) = list
        .items
        .into_iter()
        .partition(|p| p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_DECODER));
    Ok(Observed {
        decoders: ctx.pod_writes.overlay(key, decoders),
        trainers,
        source_outage,
    })
}

/// How long after a sidecar's last `SourceUnavailable` Event the outage counts as current: the
/// sidecars repeat it each minute while delivery stays stopped.
const SOURCE_OUTAGE_FRESH: Duration = Duration::from_secs(180);

/// The note of the newest `SourceUnavailable` Event a sidecar recorded on the pipeline, if it
/// is recent. A failed read leaves the condition as it was told last time, rather than fail the
/// reconcile over a report.
async fn source_outage(ctx: &Context, (namespace, name): &PipelineKey) -> Option<String> {
    let events: Api<CoreEvent> = Api::namespaced(ctx.client.clone(), namespace);
    let fields = format!(
        "involvedObject.kind=DataPipeline,involvedObject.name={name},reason={SOURCE_UNAVAILABLE}"
    );
    let list = match events.list(&ListParams::default().fields(&fields)).await {
        Ok(list) => list,
        Err(err) => {
            tracing::debug!(%err, pipeline = %name, "reading SourceUnavailable events");
            return None;
        }
    };
    let fresh_after = Timestamp::now() - SOURCE_OUTAGE_FRESH;
    list.items
        .into_iter()
        .filter_map(|e| Some((last_seen(&e)?, e.message.unwrap_or_default())))
        .filter(|(seen, _)| *seen > fresh_after)
        .max_by_key(|(seen, _)| *seen)
        .map(|(_, note)| note)
}

/// When an Event was last observed: its series' last time, else when it was recorded.
fn last_seen(e: &CoreEvent) -> Option<Timestamp> {
    let series = e
        .series
        .as_ref()
        .and_then(|s| s.last_observed_time.as_ref());
    series
        .or(e.event_time.as_ref())
        .map(|t| t.0)
        .or_else(|| e.last_timestamp.as_ref().map(|t| t.0))
}

/// The autoscaler's part: a decision once per period (between them the count in effect
/// stands), and where new decoders must not go.
async fn decide(
    ctx: &Context,
    dp: &DataPipeline,
    observed: &Observed,
    now: Timestamp,
) -> Result<Scale, Error> {
    let Some(autoscaler) = &ctx.autoscaler else {
        return Ok(Scale::default());
    };
    let decision = match dp.spec.autoscaling.mode {
        AutoscalingMode::Off => None,
        _ => autoscaler.decide(&ctx.client, dp, observed, now).await,
    };
    Ok(Scale {
        decision,
        in_effect: dp
            .status
            .as_ref()
            .map(|s| u32::try_from(s.decoders.desired).unwrap_or(0)),
        avoid_nodes: autoscaler.avoid_nodes(dp),
    })
}

/// An autoscaler that could not decide (its node list failed) shows as `Degraded` unless the
/// reconcile found a problem of its own, with a Warning Event when it starts; the rest of the
/// reconcile went on without a decision.
async fn autoscaler_degraded(
    ctx: &Context,
    dp: &DataPipeline,
    new_status: &mut DataPipelineStatus,
    now: Timestamp,
) {
    let Some(d) = ctx.autoscaler.as_ref().and_then(|a| a.degraded(dp)) else {
        return;
    };
    let degraded = |s: &DataPipelineStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == status::DEGRADED)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    if degraded(new_status).is_some_and(|(s, _)| s == "True") {
        return;
    }
    let was = dp.status.as_ref().and_then(degraded);
    status::set_condition(
        &mut new_status.conditions,
        status::DEGRADED,
        "True",
        d.reason,
        d.message.clone(),
        dp.meta().generation,
        now,
    );
    if was.is_none_or(|(_, reason)| reason != d.reason) {
        publish(
            ctx,
            &dp.object_ref(&()),
            d.reason,
            &d.message,
            EventType::Warning,
        )
        .await;
    }
}

/// The status of a pipeline that cannot run as written: nothing is applied.
fn invalid_status(
    dp: &DataPipeline,
    observed: &Observed,
    scale: &Scale,
    problems: Vec<String>,
    now: Timestamp,
) -> DataPipelineStatus {
    let count = crate::autoscale::decoder_count(&dp.spec, scale.decision.as_ref(), scale.in_effect);
    let obs = status::Observation {
        fleet: fleet::fleet_status(&observed.decoders, count_i32(count.replicas)),
        trainers: trainers::trainer_status(&observed.trainers),
        problems,
        failed_replaced: 0,
        source_outage: observed.source_outage.clone(),
        scale_reason: count.reason,
        autoscale: scale.decision.as_ref(),
    };
    status::desired_status(dp, obs, now)
}

/// The status once this reconcile's changes settle: drained decoders no longer serve.
fn settled_status(
    dp: &DataPipeline,
    observed: &Observed,
    desired: &Desired,
    scale: &Scale,
    now: Timestamp,
) -> DataPipelineStatus {
    let changes = &desired.decoders;
    let mut fleet_status = fleet::fleet_status(&observed.decoders, count_i32(changes.replicas));
    let drained = i32::try_from(changes.drain.len()).unwrap_or(0);
    fleet_status.draining += drained;
    fleet_status.ready = (fleet_status.ready - drained).max(0);
    let obs = status::Observation {
        fleet: fleet_status,
        trainers: trainers::trainer_status(&observed.trainers),
        problems: Vec::new(),
        failed_replaced: changes.failed,
        source_outage: observed.source_outage.clone(),
        scale_reason: changes.reason.clone(),
        autoscale: scale.decision.as_ref(),
    };
    status::desired_status(dp, obs, now)
}

fn count_i32(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Logs and Events for what this reconcile changed in the fleet and what the autoscaler said.
async fn report(
    ctx: &Context,
    dp: &DataPipeline,
    (namespace, name): &PipelineKey,
    changes: &DecoderChanges,
    scale: &Scale,
) {
    let reference = dp.object_ref(&());
    if changes.any() {
        tracing::info!(
            pipeline = %name,
            %namespace,
            desired = changes.replicas,
            created = changes.create.len(),
            draining = changes.drain.len(),
            deleted = changes.delete.len(),
            failed = changes.failed,
            "decoder fleet changed"
        );
    }
    if !changes.create.is_empty() || !changes.drain.is_empty() || changes.failed > 0 {
        let note = format!(
            "decoders: {} desired; created {}, draining {}, replaced {} failed",
            changes.replicas,
            changes.create.len(),
            changes.drain.len(),
            changes.failed
        );
        publish(ctx, &reference, "ScaledDecoders", &note, EventType::Normal).await;
    }
    if let Some(d) = scale.decision.as_ref().filter(|d| d.scales()) {
        publish(
            ctx,
            &reference,
            "AutoscalerDecision",
            &d.reason,
            EventType::Normal,
        )
        .await;
    }
}

/// Writes the status, exports the fleet's gauges, and announces a change of readiness.
async fn write_status(
    ctx: &Context,
    dp: &DataPipeline,
    (namespace, name): &PipelineKey,
    new_status: &DataPipelineStatus,
) -> Result<(), Error> {
    let fleet = &new_status.decoders;
    ctx.metrics
        .fleet(namespace, name, fleet.desired, fleet.ready, fleet.draining);
    let was_ready = ready_status(dp.status.as_ref());
    let is_ready = ready_status(Some(new_status));
    let api: Api<DataPipeline> = Api::namespaced(ctx.client.clone(), namespace);
    status::write(&api, dp, new_status, FIELD_MANAGER).await?;
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
        publish(ctx, &dp.object_ref(&()), reason, &message, kind).await;
    }
    Ok(())
}

/// An autoscaled pipeline is looked at again when its next decision is due, a draining fleet
/// when its drain ends.
fn next_look(ctx: &Context, dp: &DataPipeline, observed: &Observed, desired: &Desired) -> Action {
    let mut next_look = match &ctx.autoscaler {
        Some(a) if dp.spec.autoscaling.mode != AutoscalingMode::Off => a.period().min(ctx.resync),
        _ => ctx.resync,
    };
    if observed.source_outage.is_some() {
        // Nothing announces an outage's end: look again once its last report is stale.
        next_look = next_look.min(SOURCE_OUTAGE_FRESH / 3);
    }
    match desired.decoders.requeue_after {
        Some(after) => Action::requeue(after.max(Duration::from_millis(200)).min(next_look)),
        None => Action::requeue(next_look),
    }
}

fn ready_status(status: Option<&DataPipelineStatus>) -> Option<String> {
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
