//! Tells the pipeline's users that its source refuses the samples: a Warning Event on the
//! DataPipeline (`kubectl describe datapipeline` shows it; the operator turns it into the
//! `SourceUnavailable` condition), repeated each minute while delivery stays stopped so the
//! Event's series shows the outage is current.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::watch;

/// How often an ongoing outage is reported again.
const REPEAT: Duration = Duration::from_secs(60);
/// The Event's reason, which the operator looks for.
pub const REASON: &str = "SourceUnavailable";

/// The DataPipeline the Events are about.
#[derive(Debug, Clone)]
pub struct EventSubject {
    pub name: String,
    pub namespace: String,
    /// Without it `kubectl describe` does not match the Event to the object.
    pub uid: Option<String>,
}

impl EventSubject {
    fn object_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(format!("{}/v1alpha1", stoker_contract::GROUP)),
            kind: Some("DataPipeline".to_string()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: self.uid.clone(),
            ..ObjectReference::default()
        }
    }
}

/// Publishes an Event while `source_down` holds a cause; returns when the sender is gone.
pub async fn report_source_unavailable(
    client: kube::Client,
    pipeline: EventSubject,
    pod: Option<String>,
    mut source_down: watch::Receiver<Option<String>>,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "stoker-loader".to_string(),
            instance: pod,
        },
    );
    let regarding = pipeline.object_ref();
    loop {
        let cause = source_down.borrow_and_update().clone();
        if let Some(cause) = cause {
            let event = Event {
                type_: EventType::Warning,
                reason: REASON.to_string(),
                // The API server refuses notes above 1 kB.
                note: Some(cause.chars().take(1000).collect()),
                action: "GetObject".to_string(),
                secondary: None,
            };
            if let Err(err) = recorder.publish(&event, &regarding).await {
                tracing::warn!(%err, pipeline = %pipeline.name, "recording the SourceUnavailable event");
            }
            let _ = tokio::time::timeout(REPEAT, source_down.changed()).await;
        } else if source_down.changed().await.is_err() {
            return;
        }
    }
}
