//! What the operator's own objects belong to. The webhook's certificate Secret, the pipelines'
//! CA Secret and the leader Lease are made at run time, so Helm does not know them; each carries
//! an ownerReference to the installation's MutatingWebhookConfiguration (Helm's, named by
//! `--webhook-configuration`), and the garbage collector deletes them when `helm uninstall`
//! deletes it. A cluster-scoped owner may own namespaced objects. No `blockOwnerDeletion`: that
//! would need the `finalizers` permission on the owner, and nothing must outlive it anyway.

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

/// The reference to the installation's webhook configuration; `None`, with a warning, when it
/// cannot be read (an operator run without one: its objects then stay after it).
pub async fn owner(client: &Client, webhook_configuration: &str) -> Option<OwnerReference> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    match api.get(webhook_configuration).await {
        Ok(cfg) => cfg.owner_ref(&()),
        Err(e) => {
            tracing::warn!(webhook_configuration, error = %e,
                "no owner for the operator's Secrets and Lease: they will outlive an uninstall");
            None
        }
    }
}

/// `owner` as an object's whole ownerReferences (the operator's own objects have no other).
pub fn references(owner: Option<&OwnerReference>) -> Option<Vec<OwnerReference>> {
    owner.map(|o| vec![o.clone()])
}

/// Whether `obj` lacks `owner` (an object written before owners were set, or by another
/// installation's operator).
pub fn lacks(obj: &impl Resource, owner: &OwnerReference) -> bool {
    !obj.meta()
        .owner_references
        .iter()
        .flatten()
        .any(|r| r.uid == owner.uid)
}

/// Adds `owner` to an existing object that lacks it, leaving everything else as it is. A
/// failure is only logged: the object still works, it would just outlive an uninstall.
pub async fn adopt<K>(api: &Api<K>, obj: &K, owner: &OwnerReference)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    if !lacks(obj, owner) {
        return;
    }
    let mut refs = obj.meta().owner_references.clone().unwrap_or_default();
    refs.push(owner.clone());
    let patch = serde_json::json!({ "metadata": { "ownerReferences": refs } });
    let name = obj.name_any();
    if let Err(e) = api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::warn!(kind = %K::kind(&()), %name, error = %e,
            "could not set the owner: the object will outlive an uninstall");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::ObjectMeta;

    fn owner(uid: &str) -> OwnerReference {
        OwnerReference {
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: "MutatingWebhookConfiguration".into(),
            name: "stoker".into(),
            uid: uid.into(),
            ..OwnerReference::default()
        }
    }

    #[test]
    fn an_object_is_adopted_only_by_an_owner_it_lacks() {
        let mut secret = Secret {
            metadata: ObjectMeta::default(),
            ..Secret::default()
        };
        assert!(lacks(&secret, &owner("a")));
        secret.metadata.owner_references = references(Some(&owner("a")));
        assert!(!lacks(&secret, &owner("a")));
        // A reinstalled webhook configuration is a new owner.
        assert!(lacks(&secret, &owner("b")));
    }
}
