//! The report step of a reconcile, its only writes besides [`super::apply`]: the status
//! (through the status subresource, only when it changed), the fleet's gauges, and Events on
//! transitions (fleet changes, autoscaler decisions, readiness, a new degradation, a failure).

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::desired::{DecoderChanges, Desired, Scale};
use super::{Context, Error, FIELD_MANAGER, status};
use crate::api::v1alpha1::DataPipelineStatus;
use crate::api::{DataPipeline, PipelineKey};

/// A failed reconcile shows where users look: `Degraded=True` with the error's category as
/// the reason and its message, and a Warning Event with the same reason.
pub async fn report_failure(ctx: &Context, dp: &DataPipeline, key: &PipelineKey, error: &Error) {
    let (reason, message) = (error.reason(), error.summary());
    if !key.namespace.is_empty() {
        let new_status = status::failed_status(dp, &reason, &message, Timestamp::now());
        let api: Api<DataPipeline> = Api::namespaced(ctx.client.clone(), &key.namespace);
        if let Err(e) = write(&api, dp, &new_status, FIELD_MANAGER).await {
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

/// Logs and Events for what this reconcile changed in the fleet and what the autoscaler said.
pub async fn changes(
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
pub async fn write_status(
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
    write(&api, dp, new_status, FIELD_MANAGER).await?;
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

/// Writes the status through the status subresource when it differs from what is stored.
pub async fn write(
    api: &Api<DataPipeline>,
    dp: &DataPipeline,
    status: &DataPipelineStatus,
    field_manager: &str,
) -> Result<bool, Error> {
    if dp.status.as_ref() == Some(status) {
        return Ok(false);
    }
    let body = json!({
        "apiVersion": "stoker.dev/v1alpha1",
        "kind": "DataPipeline",
        "status": status,
    });
    match api
        .patch_status(
            &dp.name_any(),
            &PatchParams::apply(field_manager).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(true),
        // Deleted while this reconcile ran: nothing left to report on.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(source) => Err(Error::Kube {
            verb: "patch status of",
            kind: "DataPipeline",
            namespace: dp.namespace().unwrap_or_default(),
            name: dp.name_any(),
            source,
        }),
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
    reference: &ObjectReference,
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
