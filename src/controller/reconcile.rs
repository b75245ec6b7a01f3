//! One reconcile, as a pipeline of named steps. Only observe, apply and report touch the
//! API server:
//!
//! [`observe`] (reads: caches, two Secrets) → [`validate`] (a failure stops here, with a
//! condition) → [`decide`] (the autoscaler, in memory) → [`desired`] (pure: every child and
//! every write as a typed value) → [`apply`] (writes, prunes what left `Desired`) → status
//! (pure) → [`report`] (the status written, Events on transitions).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::runtime::controller::Action;

use super::desired::{Desired, Scale, desired};
use super::observe::{Observed, SOURCE_OUTAGE_FRESH, observe};
use super::{Context, Error, apply, fleet, index, report, status, trainers, validate};
use crate::api::v1alpha1::{AutoscalingMode, DataPipelineStatus};
use crate::api::{DataPipeline, PipelineKey, RESERVED_NAMESPACES};

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
        Err(error) => report::report_failure(&ctx, &dp, &key, error).await,
    }
    result
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
    if RESERVED_NAMESPACES.contains(&key.namespace.as_str()) {
        // Admission refuses these; one that exists anyway (made before the webhook, or with it
        // off) gets nothing from the operator, not even a status.
        tracing::warn!(pipeline = %key, "not reconciled: a pipeline in one of the cluster's own namespaces");
        return Ok(Action::await_change());
    }
    let now = Timestamp::now();
    let observed = observe(ctx, dp, &key, now).await?;
    let problems = validate::validate(&dp.spec, &ctx.defaults);
    if !problems.is_empty() {
        let status = invalid_status(dp, &observed, &in_effect(ctx, dp), problems, now);
        report::write_status(ctx, dp, &key, &status, None).await?;
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
    report::changes(ctx, dp, &key, &desired, &scale).await;
    let (status, raised) = settled_status(dp, &observed, &desired, &scale, now);
    report::write_status(ctx, dp, &key, &status, raised).await?;
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
    if let Some(record) = &desired.certs.record {
        status.certificate = Some(record.clone());
    }
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
