//! The read half of a reconcile: everything the pure steps decide on, in one [`Observed`].
//! Reads come from the controller's watch caches ([`ChildStores`]) wherever it has them; the
//! API server is asked only for what no cache holds (the CA Secret, and whether the pipeline's
//! certificate Secret exists: the operator watches and reads no Secret of a pipeline's
//! namespace) and, while a cache still fills, for the pods. Nothing here writes: the one
//! create is a dry run.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use kube::{Resource, ResourceExt};

use super::index::IndexObserved;
use super::status::SOURCE_UNAVAILABLE;
use super::{ChildStores, Context, Error, owned_by, trainers};
use crate::api::v1alpha1::AutoscalingMode;
use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, PipelineKey, ROLE_DECODER};
use crate::build::decoder_pod::tls_secret_name;
use crate::build::index_job::LABEL_INDEX_OF;
use crate::certs::pipeline::{CA_SECRET, CertSecrets, ca_namespace};
use crate::signal_source::{AutoscaleInput, Degradation, FleetPods};

/// What one reconcile knows of the world.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// The pipeline's decoder pods, with the controller's own recent writes laid over the
    /// cache (see [`super::expectations`]).
    pub decoders: Vec<Pod>,
    pub trainers: Vec<Pod>,
    /// What a sidecar last said about the source refusing samples, while it is recent.
    pub source_outage: Option<String>,
    /// The index Jobs and their pods (empty unless the source is indexed).
    pub index: IndexObserved,
    /// The CA Secret, and what is known of the pipeline's certificate Secret.
    pub certs: CertSecrets,
    /// What the autoscaler decides on, when a decision is due.
    pub autoscale: Option<AutoscaleInput>,
    /// Why the autoscaler could not decide at its last try, if it could not.
    pub autoscaler_degraded: Option<Degradation>,
}

/// How long after a sidecar's last `SourceUnavailable` Event the outage counts as current: the
/// sidecars repeat it each minute while delivery stays stopped.
pub const SOURCE_OUTAGE_FRESH: Duration = Duration::from_secs(180);

/// Reads everything the reconcile of `dp` decides on.
pub async fn observe(
    ctx: &Context,
    dp: &DataPipeline,
    key: &PipelineKey,
    now: Timestamp,
) -> Result<Observed, Error> {
    let cached = ctx.children();
    let (decoders, trainers) = pods(ctx, cached.as_ref(), dp, key).await?;
    let decoders = ctx.pod_writes.overlay(key, decoders);
    let index = match dp.spec.source.indexed() {
        Some(_) => index(ctx, cached.as_ref(), dp, key).await?,
        None => IndexObserved::default(),
    };
    let autoscale = autoscale_input(ctx, dp, &decoders, &trainers, now);
    Ok(Observed {
        source_outage: cached.as_ref().and_then(|c| source_outage(c, key, now)),
        certs: cert_secrets(ctx, dp, key).await?,
        autoscaler_degraded: ctx.autoscaler.as_ref().and_then(|a| a.degraded(dp)),
        decoders,
        trainers,
        index,
        autoscale,
    })
}

fn get_err(
    verb: &'static str,
    kind: &'static str,
    namespace: &str,
    name: &str,
) -> impl Fn(kube::Error) -> Error {
    let (namespace, name) = (namespace.to_string(), name.to_string());
    move |source| Error::Kube {
        verb,
        kind,
        namespace: namespace.clone(),
        name: name.clone(),
        source,
    }
}

/// The pipeline's decoder and trainer pods: from the caches, listed while they fill. A
/// decoder is a pod the pipeline owns, not one that only carries its labels: a copied label
/// neither counts toward the fleet nor gets drained or deleted by the operator.
async fn pods(
    ctx: &Context,
    cached: Option<&ChildStores>,
    dp: &DataPipeline,
    key: &PipelineKey,
) -> Result<(Vec<Pod>, Vec<Pod>), Error> {
    let PipelineKey { namespace, name } = key;
    let labelled = match cached.filter(|c| c.pods_ready()) {
        Some(c) => (
            ChildStores::pods_of(&c.decoders, namespace, name),
            ChildStores::pods_of(&c.trainers, namespace, name),
        ),
        None => Api::<Pod>::namespaced(ctx.client.clone(), namespace)
            .list(&ListParams::default().labels(&format!("{LABEL_PIPELINE}={name}")))
            .await
            .map_err(get_err("list", "Pod", namespace, name))?
            .items
            .into_iter()
            .partition(|p| p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_DECODER)),
    };
    Ok(decoders_owned(dp, labelled))
}

/// Keeps, of the labelled decoders, those `dp` owns.
fn decoders_owned(
    dp: &DataPipeline,
    (decoders, trainers): (Vec<Pod>, Vec<Pod>),
) -> (Vec<Pod>, Vec<Pod>) {
    let uid = dp.uid().unwrap_or_default();
    let (owned, impostors): (Vec<Pod>, Vec<Pod>) =
        decoders.into_iter().partition(|p| owned_by(p, &uid));
    for p in &impostors {
        tracing::warn!(pod = %p.name_any(), pipeline = %dp.name_any(), "a pod labelled as the pipeline's decoder that it does not own: ignored");
    }
    (owned, trainers)
}

/// The index Jobs `dp` owns and their pods.
async fn index(
    ctx: &Context,
    cached: Option<&ChildStores>,
    dp: &DataPipeline,
    key: &PipelineKey,
) -> Result<IndexObserved, Error> {
    let uid = dp.meta().uid.clone().unwrap_or_default();
    let jobs = cached.map_or_else(Vec::new, |c| ChildStores::owned(&c.jobs, &uid));
    let of_pipeline = |p: &Pod| {
        p.namespace().as_deref() == Some(key.namespace.as_str())
            && p.labels().get(LABEL_INDEX_OF) == Some(&key.name)
    };
    let pods = match cached.filter(|c| ChildStores::ready(&c.index_pods)) {
        Some(c) => c
            .index_pods
            .state()
            .iter()
            .filter(|p| of_pipeline(p))
            .map(|p| Pod::clone(p))
            .collect(),
        None => {
            Api::<Pod>::namespaced(ctx.client.clone(), &key.namespace)
                .list(&ListParams::default().labels(&format!("{LABEL_INDEX_OF}={}", key.name)))
                .await
                .map_err(get_err(
                    "list",
                    "Pod",
                    &key.namespace,
                    &format!("index pods of {}", key.name),
                ))?
                .items
        }
    };
    Ok(IndexObserved { jobs, pods })
}

/// The installation's CA Secret (the operator's own namespace, read under its Role), whether
/// the pipeline's certificate Secret exists, and what its status records of it. That Secret
/// is never read: a dry-run create answers 409 when it exists and writes nothing.
async fn cert_secrets(
    ctx: &Context,
    dp: &DataPipeline,
    key: &PipelineKey,
) -> Result<CertSecrets, Error> {
    let ca_namespace = ca_namespace(&key.namespace);
    let read_ca = async {
        Api::<Secret>::namespaced(ctx.client.clone(), &ca_namespace)
            .get_opt(CA_SECRET)
            .await
            .map_err(get_err("get", "Secret", &ca_namespace, CA_SECRET))
    };
    let name = tls_secret_name(dp);
    let probe = async {
        let placeholder = Secret {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Secret::default()
        };
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match Api::<Secret>::namespaced(ctx.client.clone(), &key.namespace)
            .create(&dry_run, &placeholder)
            .await
        {
            Ok(_) => Ok(false),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(true),
            Err(source) => Err(get_err("dry-run create", "Secret", &key.namespace, &name)(
                source,
            )),
        }
    };
    let (ca, pipeline_exists) = futures::try_join!(read_ca, probe)?;
    Ok(CertSecrets {
        ca,
        pipeline_exists,
        issued: dp.status.as_ref().and_then(|s| s.certificate.clone()),
    })
}

/// The note of the newest `SourceUnavailable` Event a sidecar recorded on the pipeline, if it
/// is recent (the controller watches those Events).
fn source_outage(cached: &ChildStores, key: &PipelineKey, now: Timestamp) -> Option<String> {
    let fresh_after = now - SOURCE_OUTAGE_FRESH;
    cached
        .outage_events
        .state()
        .iter()
        .filter(|e| {
            let about = &e.involved_object;
            e.reason.as_deref() == Some(SOURCE_UNAVAILABLE)
                && about.namespace.as_deref() == Some(key.namespace.as_str())
                && about.name.as_deref() == Some(key.name.as_str())
        })
        .filter_map(|e| Some((last_seen(e)?, e.message.clone().unwrap_or_default())))
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

/// The autoscaler's input, when it runs for `dp` and a decision is due (never waits).
fn autoscale_input(
    ctx: &Context,
    dp: &DataPipeline,
    decoders: &[Pod],
    trainers: &[Pod],
    now: Timestamp,
) -> Option<AutoscaleInput> {
    let autoscaler = ctx.autoscaler.as_ref()?;
    if dp.spec.autoscaling.mode == AutoscalingMode::Off {
        return None;
    }
    let seen = trainers::trainer_status(trainers);
    let pods = FleetPods {
        decoders,
        trainers,
        world_size: u32::try_from(seen.world_size.max(seen.pods)).unwrap_or(0),
    };
    autoscaler.observe(&ctx.client, dp, pods, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn pod(name: &str, owner_uid: Option<&str>) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.owner_references = owner_uid.map(|uid| {
            vec![OwnerReference {
                uid: uid.into(),
                controller: Some(true),
                ..OwnerReference::default()
            }]
        });
        p
    }

    #[test]
    fn a_pod_with_copied_labels_is_no_decoder_of_the_pipeline() {
        let mut dp: DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        dp.metadata.uid = Some("dp-uid".into());
        let labelled = vec![
            pod("ours", Some("dp-uid")),
            pod("copied-labels", None),
            pod("another-owner", Some("other-uid")),
        ];
        let trainers = vec![pod("trainer", None)];
        let (decoders, kept) = decoders_owned(&dp, (labelled, trainers));
        let names: Vec<String> = decoders.iter().map(|p| p.name_any()).collect();
        assert_eq!(names, ["ours"]);
        assert_eq!(
            kept.len(),
            1,
            "trainers are the user's pods: kept as they are"
        );
    }
}
