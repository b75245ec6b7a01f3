//! The I/O half of a reconcile: server-side apply of children and the fleet plan's pod changes.

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::Error;
use crate::api::{ANNOTATION_DRAIN_STARTED, LABEL_DRAINING};

/// Applies one child with the operator's field manager. Applying an object that is already
/// right changes nothing on the server (no new resourceVersion).
pub async fn apply<K>(client: &Client, obj: &K, field_manager: &str) -> Result<K, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + std::fmt::Debug,
{
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

fn short_kind<K: Resource<DynamicType = ()>>() -> &'static str {
    match K::kind(&()).as_ref() {
        "Pod" => "Pod",
        "Service" => "Service",
        "ConfigMap" => "ConfigMap",
        "NetworkPolicy" => "NetworkPolicy",
        "Role" => "Role",
        "RoleBinding" => "RoleBinding",
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
/// from the sidecars' selector; it is deleted once its drain period has passed.
pub async fn drain(
    api: &Api<Pod>,
    name: &str,
    field_manager: &str,
    now: Timestamp,
) -> Result<(), Error> {
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
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
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
