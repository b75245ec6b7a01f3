//! The write half of a reconcile: everything [`Desired`] says, and nothing else. Children are
//! server-side applied (skipped when the cache shows them as built), the certificate Secrets
//! written CA first, the index Job created once, decoder pods created, drained and deleted,
//! trainers told their local-decode share; then every owned child of a pruned kind that
//! `Desired` no longer names is deleted ([`stale`]).

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::desired::{DecoderChanges, Desired};
use super::local_share::LocalShare;
use super::{ChildStores, Context, Error, FIELD_MANAGER, owned_by};
use crate::api::{ANNOTATION_DRAIN_STARTED, LABEL_DRAINING, PipelineKey};
use crate::certs::pipeline::CertChanges;

/// Pod writes one reconcile keeps in flight: fast scale-up without a burst that trips API
/// priority and fairness.
const POD_WRITES_IN_FLIGHT: usize = 16;

/// Applies every child of `desired`. Taking [`Desired`] apart field by field (no `..`) is
/// what makes a new child fail to compile until it is applied here.
pub async fn apply_desired(
    ctx: &Context,
    key: &PipelineKey,
    desired: &Desired,
    now: Timestamp,
) -> Result<(), Error> {
    let Desired {
        service,
        network_policy,
        sidecar_role,
        sidecar_role_binding,
        sidecar_service_account,
        sidecar_token,
        decoder_service_account,
        index_job,
        certs,
        local_share,
        decoders,
    } = desired;
    let client = &ctx.client;
    // Before the decoders that mount it: a pod whose Secret is missing waits for it.
    write_certificates(client, certs).await?;
    // The watches' copies: children already as built are not applied again.
    let cached = ctx.children();
    let c = cached.as_ref();
    let accounts = c.map(|c| &c.service_accounts);
    let decoder_account = async {
        match decoder_service_account {
            Some(sa) => apply_child(client, sa, accounts).await,
            None => Ok(false),
        }
    };
    // The Role before its RoleBinding: the API server refuses to bind a Role it cannot find
    // (NotFound). Then the rest at once, each to its end: one failing apply must not abort
    // the others mid-request (under load a slow one would never land).
    let role = apply_child(client, sidecar_role, c.map(|c| &c.roles)).await?;
    let (service_applied, network_policy_applied, role_binding, account, decoder_account) = futures::join!(
        apply_child(client, service, c.map(|c| &c.services)),
        apply_child(client, network_policy, c.map(|c| &c.network_policies)),
        apply_child(client, sidecar_role_binding, c.map(|c| &c.role_bindings)),
        apply_child(client, sidecar_service_account, accounts),
        decoder_account,
    );
    ctx.metrics.children_applied(&[
        role,
        service_applied?,
        network_policy_applied?,
        role_binding?,
        account?,
        decoder_account?,
    ]);
    create_token_secret(ctx, sidecar_token).await?;
    if let Some(job) = index_job {
        ensure_job(ctx, job).await?;
    }
    if let Some(share) = local_share {
        tell_local_share(client, &key.namespace, share).await;
    }
    apply_decoder_changes(ctx, key, decoders, now).await?;
    let Some(stores) = c else {
        return Ok(());
    };
    let owner = desired_owner(service);
    let (services, policies) = ([Some(service)], [Some(network_policy)]);
    let (roles, bindings) = ([Some(sidecar_role)], [Some(sidecar_role_binding)]);
    let accounts = [
        Some(sidecar_service_account),
        decoder_service_account.as_ref(),
    ];
    let jobs = [index_job.as_ref()];
    futures::try_join!(
        prune(client, &stores.services, &owner, &services),
        prune(client, &stores.network_policies, &owner, &policies),
        prune(client, &stores.roles, &owner, &roles),
        prune(client, &stores.role_bindings, &owner, &bindings),
        prune(client, &stores.service_accounts, &owner, &accounts),
        prune(client, &stores.jobs, &owner, &jobs),
    )?;
    Ok(())
}

/// The pipeline's UID, as every child it owns names it.
fn desired_owner(child: &impl Resource) -> String {
    child
        .meta()
        .owner_references
        .iter()
        .flatten()
        .map(|o| o.uid.clone())
        .next()
        .unwrap_or_default()
}

/// The names of the objects in `cached` that `owner_uid` owns and `keep` does not name (nor
/// already being deleted): what pruning deletes. An object another owner (or nobody) owns is
/// never touched, whatever its name.
pub fn stale<K: Resource>(cached: &[K], owner_uid: &str, keep: &[Option<&K>]) -> Vec<String> {
    let kept: Vec<String> = keep.iter().flatten().map(|k| k.name_any()).collect();
    cached
        .iter()
        .filter(|o| owned_by(*o, owner_uid))
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .map(ResourceExt::name_any)
        .filter(|name| !kept.contains(name))
        .collect()
}

/// Deletes the owned objects of one kind that left `Desired`; a Job's pods go with it.
async fn prune<K: Child + 'static>(
    client: &Client,
    store: &Store<K>,
    owner_uid: &str,
    keep: &[Option<&K>],
) -> Result<(), Error> {
    let cached: Vec<K> = ChildStores::owned(store, owner_uid);
    let names = stale(&cached, owner_uid, keep);
    let Some(namespace) = keep
        .iter()
        .flatten()
        .find_map(|k| k.namespace())
        .or_else(|| cached.first().and_then(ResourceExt::namespace))
    else {
        return Ok(());
    };
    let api: Api<K> = Api::namespaced(client.clone(), &namespace);
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    };
    for name in names {
        match api.delete(&name, &params).await {
            Ok(_) => {
                tracing::info!(kind = %K::kind(&()), %namespace, %name, "pruned a child the pipeline no longer has")
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(source) => {
                return Err(Error::Kube {
                    verb: "delete",
                    kind: short_kind::<K>(),
                    namespace,
                    name,
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Writes the CA Secret (create, or replace at the resourceVersion observed) and then the
/// pipeline's certificate. A CA another reconcile wrote first makes this one stale: its
/// certificate, signed by the loser, is never written.
async fn write_certificates(client: &Client, certs: &CertChanges) -> Result<(), Error> {
    if let Some(ca) = &certs.ca {
        let namespace = ca.namespace().unwrap_or_default();
        let name = ca.name_any();
        let api: Api<Secret> = Api::namespaced(client.clone(), &namespace);
        let written = match ca.metadata.resource_version {
            None => api.create(&PostParams::default(), ca).await,
            Some(_) => api.replace(&name, &PostParams::default(), ca).await,
        };
        match written {
            Ok(_) => tracing::info!(%namespace, secret = %name, "wrote the pipeline CA"),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return Err(Error::Stale {
                    kind: "Secret",
                    namespace,
                    name,
                });
            }
            Err(source) => {
                return Err(Error::Kube {
                    verb: "write",
                    kind: "Secret",
                    namespace,
                    name,
                    source,
                });
            }
        }
    }
    if let Some(secret) = &certs.pipeline {
        apply(client, secret, FIELD_MANAGER).await?;
    }
    Ok(())
}

/// Creates the index Job unless it exists. A Job's pod template is immutable and a finished
/// Job must not run again, so it is created once and never applied over.
async fn ensure_job(ctx: &Context, job: &Job) -> Result<(), Error> {
    let cached = ctx
        .children()
        .is_some_and(|c| ChildStores::live(&c.jobs, job).is_some());
    if cached {
        return Ok(());
    }
    let namespace = job.namespace().unwrap_or_default();
    let api: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PostParams::default()
    };
    match api.create(&params, job).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(Error::Kube {
            verb: "create",
            kind: "Job",
            namespace,
            name: job.name_any(),
            source,
        }),
    }
}

/// Writes the share on each trainer pod `share` names; a failed patch is retried at the next
/// decision (the pod still says otherwise then).
async fn tell_local_share(client: &Client, namespace: &str, share: &LocalShare) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let patch = Patch::Merge(share.patch());
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    };
    let patches = share
        .pods
        .iter()
        .map(|name| pods.patch(name, &params, &patch));
    let results = futures::future::join_all(patches).await;
    for (name, result) in share.pods.iter().zip(results) {
        let share = share.share;
        match result {
            Ok(_) => tracing::info!(pod = %name, %namespace, share, "local decode share set"),
            Err(e) => tracing::warn!(pod = %name, %namespace, share, error = %e,
                "local decode share not set; retried at the next decision"),
        }
    }
}

/// Creates the sidecar's token Secret once per pipeline and process (after its ServiceAccount,
/// which the token controller requires); one that exists is left alone. Create only: the
/// operator never reads the token kube-controller-manager puts there.
async fn create_token_secret(ctx: &Context, secret: &Secret) -> Result<(), Error> {
    let owner = secret
        .metadata
        .owner_references
        .iter()
        .flatten()
        .map(|o| o.uid.as_str())
        .next()
        .unwrap_or_default();
    let namespace = secret.metadata.namespace.clone().unwrap_or_default();
    let name = secret.metadata.name.clone().unwrap_or_default();
    let known = format!("{owner}/{namespace}/{name}");
    let tokens = || {
        ctx.sidecar_tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if tokens().contains(&known) {
        return Ok(());
    }
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PostParams::default()
    };
    let created = match api.create(&params, secret).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(Error::Kube {
            verb: "create",
            kind: "Secret",
            namespace,
            name,
            source,
        }),
    };
    if created.is_ok() {
        tokens().insert(known);
    }
    created
}

/// Creates, drains and deletes decoder pods, each remembered as it lands (see
/// [`super::expectations`]), so one failed write forgets none of the others.
async fn apply_decoder_changes(
    ctx: &Context,
    key: &PipelineKey,
    changes: &DecoderChanges,
    now: Timestamp,
) -> Result<(), Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let remember = |written: Vec<Pod>, deleted: Vec<String>| {
        ctx.pod_writes.record(key.clone(), written, deleted);
    };
    // Futures are made eagerly (Vecs, not lazy maps) so the reconcile future stays Send.
    let mut creates = Vec::new();
    for pod in &changes.create {
        creates.push(create(&pods, pod));
    }
    let mut drains = Vec::new();
    for name in &changes.drain {
        drains.push(drain(&pods, name, FIELD_MANAGER, now));
    }
    let mut deletes = Vec::new();
    for pod in &changes.delete {
        let pods = &pods;
        deletes.push(async move { delete(pods, pod).await.map(|()| pod.clone()) });
    }
    let limit = POD_WRITES_IN_FLIGHT;
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
    Ok(())
}

/// Creates a decoder pod the API server names (`generateName`).
async fn create(api: &Api<Pod>, pod: &Pod) -> Result<Pod, Error> {
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PostParams::default()
    };
    api.create(&params, pod).await.map_err(|source| {
        let name = pod.metadata.generate_name.clone().unwrap_or_default();
        pod_err("create", api, &name, source)
    })
}

/// A namespaced object the operator applies.
pub trait Child:
    Resource<Scope = NamespaceResourceScope, DynamicType = ()>
    + Clone
    + Serialize
    + DeserializeOwned
    + std::fmt::Debug
{
}

impl<K> Child for K where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + std::fmt::Debug
{
}

/// Applies one child with the operator's field manager. Applying an object that is already
/// right changes nothing on the server (no new resourceVersion).
async fn apply<K: Child>(client: &Client, obj: &K, field_manager: &str) -> Result<K, Error> {
    let namespace = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let api: Api<K> = Api::namespaced(client.clone(), &namespace);
    // SSA needs apiVersion and kind in the body; the typed structs omit them.
    let mut body = serde_json::to_value(obj).map_err(|source| Error::Build {
        kind: short_kind::<K>(),
        name: name.clone(),
        source,
    })?;
    if let Some(map) = body.as_object_mut() {
        map.insert("apiVersion".into(), K::api_version(&()).into());
        map.insert("kind".into(), K::kind(&()).into());
    }
    api.patch(
        &name,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| Error::Kube {
        verb: "apply",
        kind: short_kind::<K>(),
        namespace,
        name,
        source,
    })
}

/// Annotation on each child the operator applies: a hash of what it applied, so that a child
/// built differently (a field dropped, not just changed) is told from one that is up to date.
pub const ANNOTATION_APPLIED_HASH: &str = "stoker.dev/applied-hash";

/// Applies `obj` unless its copy in `cache` (the watch's) already is what applying would make
/// it: then the reconcile saves the round trip (four a pipeline, every resync). Returns whether
/// it applied.
pub async fn apply_child<K: Child>(
    client: &Client,
    obj: &K,
    cache: Option<&Store<K>>,
) -> Result<bool, Error> {
    let stamped = stamp_applied_hash(obj);
    let live = cache.and_then(|store| ChildStores::live(store, obj));
    if live.is_some_and(|live| unchanged(&stamped, &live)) {
        return Ok(false);
    }
    apply(client, &stamped, FIELD_MANAGER).await?;
    Ok(true)
}

/// `obj` with [`ANNOTATION_APPLIED_HASH`] set to the hash of `obj` as built.
pub fn stamp_applied_hash<K>(obj: &K) -> K
where
    K: Resource<DynamicType = ()> + Clone + Serialize,
{
    // As `template_hash`: typed objects always serialize; an empty hash would only cost an apply.
    let bytes = serde_json::to_vec(obj).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let mut stamped = obj.clone();
    stamped
        .meta_mut()
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANNOTATION_APPLIED_HASH.to_string(), hash);
    stamped
}

/// Whether applying `stamped` (a built child with its hash) would leave `live` as it is: the
/// same hash, so built from the same fields, and every field it sets still has its value, so
/// nobody changed or removed one since. What the server added (defaults, status) is ignored.
pub fn unchanged<K: Resource + Serialize>(stamped: &K, live: &K) -> bool {
    if live.meta().deletion_timestamp.is_some() {
        return false;
    }
    match (serde_json::to_value(stamped), serde_json::to_value(live)) {
        (Ok(built), Ok(live)) => covers(&live, &built),
        _ => false,
    }
}

/// Whether every field of `built` has the same value in `live`; lists must match in length
/// and element by element. A field the server leaves out matches a built zero value (`false`,
/// `0`, `""`, empty): Go's `omitempty` drops those, so `publishNotReadyAddresses: false` never
/// comes back.
fn covers(live: &Value, built: &Value) -> bool {
    match (live, built) {
        (Value::Object(live), Value::Object(built)) => {
            built.iter().all(|(k, b)| match live.get(k) {
                Some(l) => covers(l, b),
                None => is_zero(b),
            })
        }
        (Value::Array(live), Value::Array(built)) => {
            live.len() == built.len() && live.iter().zip(built).all(|(l, b)| covers(l, b))
        }
        _ => live == built,
    }
}

fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

fn short_kind<K: Resource<DynamicType = ()>>() -> &'static str {
    match K::kind(&()).as_ref() {
        "Pod" => "Pod",
        "Service" => "Service",
        "NetworkPolicy" => "NetworkPolicy",
        "Role" => "Role",
        "RoleBinding" => "RoleBinding",
        "ServiceAccount" => "ServiceAccount",
        "Job" => "Job",
        "Secret" => "Secret",
        _ => "object",
    }
}

fn pod_err(verb: &'static str, api: &Api<Pod>, name: &str, source: kube::Error) -> Error {
    Error::Kube {
        verb,
        kind: "Pod",
        namespace: api.namespace().unwrap_or_default().to_string(),
        name: name.to_string(),
        source,
    }
}

/// Takes a decoder out of discovery: the label change drops it from the Service selector and
/// from the sidecars' selector; it is deleted once its drain period has passed. Returns the
/// drained pod, `None` when it was already gone.
pub async fn drain(
    api: &Api<Pod>,
    name: &str,
    field_manager: &str,
    now: Timestamp,
) -> Result<Option<Pod>, Error> {
    let patch = json!({
        "metadata": {
            "labels": { LABEL_DRAINING: "true" },
            "annotations": { ANNOTATION_DRAIN_STARTED: now.to_string() },
        }
    });
    let params = PatchParams {
        field_manager: Some(field_manager.to_string()),
        ..PatchParams::default()
    };
    match api.patch(name, &params, &Patch::Merge(&patch)).await {
        Ok(pod) => Ok(Some(pod)),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(pod_err("drain", api, name, e)),
    }
}

pub async fn delete(api: &Api<Pod>, name: &str) -> Result<(), Error> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(pod_err("delete", api, name, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};

    fn owned<K: Resource + Default>(name: &str, owner: &str) -> K {
        let mut k = K::default();
        k.meta_mut().name = Some(name.into());
        k.meta_mut().owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                uid: owner.into(),
                ..Default::default()
            },
        ]);
        k
    }

    /// For one kind: the pipeline's child that left `Desired` is pruned, the one it keeps and
    /// another owner's of the same name are not.
    fn prunes_only_what_left<K: Resource + Default>() {
        let kept: K = owned("p-decoders", "u1");
        let cached = [
            owned::<K>("p-decoders", "u1"),
            owned::<K>("p-old", "u1"),
            owned::<K>("p-old", "someone-else"),
            K::default(),
        ];
        assert_eq!(stale(&cached, "u1", &[Some(&kept)]), ["p-old"]);
        assert_eq!(stale(&cached, "u1", &[None]), ["p-decoders", "p-old"]);
        assert!(stale(&cached, "", &[None]).is_empty(), "no owner, no prune");
    }

    #[test]
    fn every_pruned_kind_deletes_only_its_own_children_that_left() {
        prunes_only_what_left::<Service>();
        prunes_only_what_left::<NetworkPolicy>();
        prunes_only_what_left::<Role>();
        prunes_only_what_left::<RoleBinding>();
        prunes_only_what_left::<ServiceAccount>();
        prunes_only_what_left::<Job>();
    }

    #[test]
    fn a_child_being_deleted_is_not_deleted_again() {
        let mut going: Job = owned("p-index-1", "u1");
        going.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
        );
        assert!(stale(&[going], "u1", &[None]).is_empty());
    }

    fn built() -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": "p-config", "namespace": "ns", "labels": {"a": "1"}},
            "data": {"pipeline.json": "{}", "extra": "x"},
        }))
        .unwrap()
    }

    /// What the server holds after applying `stamped`: the same, plus its own fields.
    fn served(stamped: &ConfigMap) -> ConfigMap {
        let mut live = stamped.clone();
        live.metadata.uid = Some("u-1".into());
        live.metadata.resource_version = Some("42".into());
        live.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("added-by-someone".into(), "y".into());
        live
    }

    #[test]
    fn a_child_is_applied_again_only_when_applying_would_change_it() {
        let stamped = stamp_applied_hash(&built());
        assert!(
            unchanged(&stamped, &served(&stamped)),
            "server and foreign fields do not count"
        );

        let mut edited = served(&stamped);
        edited
            .data
            .as_mut()
            .unwrap()
            .insert("extra".into(), "edited".into());
        assert!(!unchanged(&stamped, &edited), "a value changed by hand");

        let mut missing = served(&stamped);
        missing.data.as_mut().unwrap().remove("extra");
        assert!(!unchanged(&stamped, &missing), "a field removed by hand");

        // The build dropped a field: the live object still covers it, the hash does not.
        let mut smaller = built();
        smaller.data.as_mut().unwrap().remove("extra");
        let smaller = stamp_applied_hash(&smaller);
        assert!(
            !unchanged(&smaller, &served(&stamped)),
            "a field the build no longer sets"
        );

        // The server leaves out zero values (Go's omitempty): they still match.
        let mut with_default = built();
        with_default.immutable = Some(false);
        let with_default = stamp_applied_hash(&with_default);
        let mut omitted = served(&with_default);
        omitted.immutable = None;
        assert!(
            unchanged(&with_default, &omitted),
            "false, left out by the server"
        );
        let mut flipped = omitted.clone();
        flipped.immutable = Some(true);
        assert!(
            !unchanged(&with_default, &flipped),
            "true is not the default"
        );

        let mut deleting = served(&stamped);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(!unchanged(&stamped, &deleting), "a child being deleted");
    }
}
