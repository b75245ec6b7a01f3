//! One reconcile, as a pipeline of named steps. Only the first and the last two touch the
//! API server:
//!
//! [`observe`] (reads: caches, two Secrets) → [`validate`] (a failure stops here, with a
//! condition) → [`decide`] (the autoscaler, in memory) → [`desired`] (pure: every child and
//! every write as a typed value) → [`apply`] (writes, prunes what left `Desired`) → status
//! (pure, then written with its Events).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};

use super::desired::{DecoderChanges, Desired, Scale, desired};
use super::observe::{Observed, SOURCE_OUTAGE_FRESH, observe};
use super::{Context, Error, FIELD_MANAGER, apply, fleet, index, status, trainers, validate};
use crate::api::v1alpha1::{AutoscalingMode, DataPipelineStatus};
use crate::api::{DataPipeline, PipelineKey};

/// How soon a reconcile that found its reads stale looks again.
const STALE_RETRY: Duration = Duration::from_millis(200);

pub async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = PipelineKey::of(&dp);
    if let Some(wait) = ctx.retries.wait(&key, dp.meta().generation, Instant::now()) {
        return Ok(Action::requeue(wait));
    }
    let started = Instant::now();
    let result = reconcile_inner(&dp, &ctx).await;
    ctx.metrics.reconciled(started.elapsed().as_secs_f64());
    match &result {
        Ok(_) => ctx.retries.succeeded(&key),
        Err(Error::Stale { kind, name, .. }) => {
            tracing::debug!(pipeline = %key, %kind, %name, "read went stale; looking again");
            return Ok(Action::requeue(STALE_RETRY));
        }
        Err(error) => report_failure(&ctx, &dp, &key, error).await,
    }
    result
}

/// A failed reconcile shows where users look: `Degraded=True` with the error's category as
/// the reason and its message, and a Warning Event with the same reason.
async fn report_failure(ctx: &Context, dp: &DataPipeline, key: &PipelineKey, error: &Error) {
    let (reason, message) = (error.reason(), error.summary());
    if !key.namespace.is_empty() {
        let new_status = status::failed_status(dp, &reason, &message, Timestamp::now());
        let api: Api<DataPipeline> = Api::namespaced(ctx.client.clone(), &key.namespace);
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
    let key = PipelineKey::of(dp);
    if key.namespace.is_empty() {
        return Err(Error::MissingNamespace(key.name));
    }
    if dp.meta().deletion_timestamp.is_some() {
        forget(ctx, dp, &key);
        return Ok(Action::await_change());
    }
    let now = Timestamp::now();
    let observed = observe(ctx, dp, &key, now).await?;
    let problems = validate::validate(&dp.spec, &ctx.defaults);
    if !problems.is_empty() {
        let status = invalid_status(dp, &observed, &in_effect(ctx, dp), problems, now);
        write_status(ctx, dp, &key, &status, None).await?;
        return Ok(Action::requeue(ctx.resync));
    }
    let scale = decide(ctx, dp, &observed, now);
    let desired = desired(
        dp,
        &observed,
        &scale,
        &ctx.defaults,
        ctx.owner.as_ref(),
        now,
    )?;
    apply::apply_desired(ctx, &key, &desired, now).await?;
    report(ctx, dp, &key, &desired, &scale).await;
    let (status, raised) = settled_status(dp, &observed, &desired, &scale, now);
    write_status(ctx, dp, &key, &status, raised).await?;
    Ok(next_look(ctx, dp, &observed, &desired))
}

/// A deleted pipeline: its children go with it through their owner references.
fn forget(ctx: &Context, dp: &DataPipeline, key: &PipelineKey) {
    ctx.metrics.forget_pipeline(&key.namespace, &key.name);
    if let Some(autoscaler) = &ctx.autoscaler {
        autoscaler.forget(dp);
    }
}

/// The count in effect and where new decoders must not go, without a new decision.
fn in_effect(ctx: &Context, dp: &DataPipeline) -> Scale {
    let Some(autoscaler) = &ctx.autoscaler else {
        return Scale::default();
    };
    Scale {
        decision: None,
        in_effect: dp
            .status
            .as_ref()
            .map(|s| u32::try_from(s.decoders.desired).unwrap_or(0)),
        avoid_nodes: autoscaler.avoid_nodes(dp),
    }
}

/// The autoscaler's part: a decision when the observe step found one due (between them the
/// count in effect stands), and where new decoders must not go. In memory only.
fn decide(ctx: &Context, dp: &DataPipeline, observed: &Observed, now: Timestamp) -> Scale {
    let Some(autoscaler) = &ctx.autoscaler else {
        return Scale::default();
    };
    let decision = observed
        .autoscale
        .as_ref()
        .map(|input| autoscaler.decide(dp, input, now));
    Scale {
        decision,
        ..in_effect(ctx, dp)
    }
}

/// An autoscaler that could not decide (its node list failed) shows as `Degraded` unless the
/// reconcile found a problem of its own; the rest of the reconcile went on without a decision.
/// Returns the degradation when it is new (it gets a Warning Event).
fn autoscaler_degraded(
    dp: &DataPipeline,
    observed: &Observed,
    new_status: &mut DataPipelineStatus,
    now: Timestamp,
) -> Option<(&'static str, String)> {
    let d = observed.autoscaler_degraded.as_ref()?;
    let degraded = |s: &DataPipelineStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == status::DEGRADED)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    if degraded(new_status).is_some_and(|(s, _)| s == "True") {
        return None;
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
    was.is_none_or(|(_, reason)| reason != d.reason)
        .then(|| (d.reason, d.message.clone()))
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

/// The status once this reconcile's changes settle (drained decoders no longer serve), with
/// the autoscaler's degradation when it is new.
fn settled_status(
    dp: &DataPipeline,
    observed: &Observed,
    desired: &Desired,
    scale: &Scale,
    now: Timestamp,
) -> (DataPipelineStatus, Option<(&'static str, String)>) {
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
    let mut status = status::desired_status(dp, obs, now);
    if let Some(job) = &desired.index_job {
        let index = index::status_of(dp, job, &observed.index);
        index::report(dp, &mut status, index, now);
    }
    let raised = autoscaler_degraded(dp, observed, &mut status, now);
    (status, raised)
}

fn count_i32(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Logs and Events for what this reconcile changed in the fleet and what the autoscaler said.
async fn report(
    ctx: &Context,
    dp: &DataPipeline,
    PipelineKey { namespace, name }: &PipelineKey,
    desired: &Desired,
    scale: &Scale,
) {
    let changes: &DecoderChanges = &desired.decoders;
    let reference = dp.object_ref(&());
    if let Some(reason) = desired.certs.reason {
        tracing::info!(pipeline = %name, %namespace, reason, "issued the pipeline's certificate");
    }
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

/// Writes the status, exports the fleet's gauges, and announces a change of readiness and a
/// newly `raised` degradation.
async fn write_status(
    ctx: &Context,
    dp: &DataPipeline,
    PipelineKey { namespace, name }: &PipelineKey,
    new_status: &DataPipelineStatus,
    raised: Option<(&'static str, String)>,
) -> Result<(), Error> {
    let fleet = &new_status.decoders;
    ctx.metrics
        .fleet(namespace, name, fleet.desired, fleet.ready, fleet.draining);
    let was_ready = ready_status(dp.status.as_ref());
    let is_ready = ready_status(Some(new_status));
    let api: Api<DataPipeline> = Api::namespaced(ctx.client.clone(), namespace);
    status::write(&api, dp, new_status, FIELD_MANAGER).await?;
    if let Some((reason, message)) = raised {
        publish(
            ctx,
            &dp.object_ref(&()),
            reason,
            &message,
            EventType::Warning,
        )
        .await;
    }
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
