//! Admission of DataPipelines: a pipeline grants its author nothing the author could not do
//! alone. The operator turns some fields into pods it creates with its own, wider rights; for
//! each of those fields the author must hold the right that field stands for, which the API
//! server answers with a SubjectAccessReview of the requesting user (docs/security.md lists
//! the fields and why the others are left out).
//!
//! [`required_rights`] and [`refusal`] are pure; [`authorize`] asks the API server.

use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};

use crate::api::{DataPipelineSpec, RESERVED_NAMESPACES};
use crate::build::BuildDefaults;

/// One thing the operator would do for a pipeline, which its author must be allowed to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Right {
    /// The field that asks for it, as the user wrote it (`decoders.image`).
    pub field: &'static str,
    pub verb: &'static str,
    /// A core (`""` group) resource.
    pub resource: &'static str,
    /// The one object it is about, when it is about one (a Secret).
    pub name: Option<String>,
}

impl Right {
    fn pods(field: &'static str) -> Self {
        Self {
            field,
            verb: "create",
            resource: "pods",
            name: None,
        }
    }
}

/// The rights `new` asks of its author: each field that ends up in a pod the operator creates
/// and gives it more than a default decoder has, when it is set and (on update, `old` being
/// the stored spec) changed. A decoder pod with a custom image, account, tolerated taints or
/// the node's cloud identity is one the author could only make with `create pods`; the S3
/// credentials are a Secret the author must be able to read. A nodeSelector only narrows
/// where a decoder may go (onto no node whose taints it does not tolerate): it asks nothing.
pub fn required_rights(
    old: Option<&DataPipelineSpec>,
    new: &DataPipelineSpec,
    defaults: &BuildDefaults,
) -> Vec<Right> {
    let changed = |same: fn(&DataPipelineSpec, &DataPipelineSpec) -> bool| {
        old.is_none_or(|old| !same(old, new))
    };
    let mut rights = Vec::new();
    let d = &new.decoders;
    let s3 = &new.source.s3;
    if d.image
        .as_deref()
        .is_some_and(|i| i != defaults.loader_image)
        && changed(|a, b| a.decoders.image == b.decoders.image)
    {
        rights.push(Right::pods("decoders.image"));
    }
    if d.service_account_name.is_some()
        && changed(|a, b| a.decoders.service_account_name == b.decoders.service_account_name)
    {
        rights.push(Right::pods("decoders.serviceAccountName"));
    }
    if !d.tolerations.is_empty() && changed(|a, b| a.decoders.tolerations == b.decoders.tolerations)
    {
        rights.push(Right::pods("decoders.tolerations"));
    }
    if s3.use_instance_metadata
        && changed(|a, b| a.source.s3.use_instance_metadata == b.source.s3.use_instance_metadata)
    {
        rights.push(Right::pods("source.s3.useInstanceMetadata"));
    }
    if let Some(secret) = &s3.credentials_secret_ref
        && changed(|a, b| a.source.s3.credentials_secret_ref == b.source.s3.credentials_secret_ref)
    {
        rights.push(Right {
            field: "source.s3.credentialsSecretRef",
            verb: "get",
            resource: "secrets",
            name: Some(secret.name.clone()),
        });
    }
    rights
}

/// What the API server said about one right.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Allowed,
    Denied,
    /// The review could not be made: refused, since these fields fail closed.
    Unknown(String),
}

/// Why `user` may not have the pipeline in `namespace`, naming each field and the missing
/// right; `None` when every right was allowed.
pub fn refusal(user: &str, namespace: &str, answered: &[(Right, Answer)]) -> Option<String> {
    let reasons: Vec<String> = answered
        .iter()
        .filter_map(|(right, answer)| {
            let what = match &right.name {
                Some(name) => format!("{} {} \"{name}\"", right.verb, singular(right.resource)),
                None => format!("{} {}", right.verb, right.resource),
            };
            match answer {
                Answer::Allowed => None,
                Answer::Denied => Some(format!(
                    "{}: user {user} may not {what} in namespace {namespace}",
                    right.field
                )),
                Answer::Unknown(why) => Some(format!(
                    "{}: could not check that user {user} may {what} in namespace {namespace} ({why}); refused until it can be",
                    right.field
                )),
            }
        })
        .collect();
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

fn singular(resource: &str) -> &str {
    resource.strip_suffix('s').unwrap_or(resource)
}

/// Why a pipeline may not live in `namespace` at all, if it may not.
pub fn namespace_refusal(namespace: &str) -> Option<String> {
    RESERVED_NAMESPACES.contains(&namespace).then(|| {
        format!("metadata.namespace: stoker runs no DataPipeline in {namespace}, which holds the cluster's own workloads")
    })
}

/// Asks the API server each of `rights` for `user` in `namespace`, all at once.
pub async fn authorize(
    client: &Client,
    user: &UserInfo,
    namespace: &str,
    rights: Vec<Right>,
) -> Vec<(Right, Answer)> {
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let asks = rights.iter().map(|right| {
        let review = access_review(user, namespace, right);
        let api = api.clone();
        async move { api.create(&PostParams::default(), &review).await }
    });
    let answers = futures::future::join_all(asks).await;
    rights
        .into_iter()
        .zip(answers)
        .map(|(right, answer)| {
            let answer = match answer {
                Ok(r) if r.status.as_ref().is_some_and(|s| s.allowed) => Answer::Allowed,
                Ok(_) => Answer::Denied,
                Err(e) => Answer::Unknown(e.to_string()),
            };
            (right, answer)
        })
        .collect()
}

/// The SubjectAccessReview of `right` for `user`, exactly as the request came (groups, uid and
/// extra included, so that group grants and impersonation scopes count as they would).
fn access_review(user: &UserInfo, namespace: &str, right: &Right) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.to_string()),
                verb: Some(right.verb.to_string()),
                group: Some(String::new()),
                resource: Some(right.resource.to_string()),
                name: right.name.clone(),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::DataPipeline;
    use crate::api::v1alpha1::SecretRef;
    use std::collections::BTreeMap;

    /// The fixture without the fields that ask for rights: what a user of defaults writes.
    fn spec() -> DataPipelineSpec {
        let dp: DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        let mut s = dp.spec;
        s.source.s3.credentials_secret_ref = None;
        s.decoders.tolerations.clear();
        s
    }

    fn fields(rights: &[Right]) -> Vec<&'static str> {
        rights.iter().map(|r| r.field).collect()
    }

    fn everything() -> DataPipelineSpec {
        let mut s = spec();
        s.decoders.image = Some("registry.example/custom:1".into());
        s.decoders.service_account_name = Some("s3-reader".into());
        s.decoders.node_selector = BTreeMap::from([("pool".into(), "reserved".into())]);
        s.decoders.tolerations = vec![Default::default()];
        s.source.s3.use_instance_metadata = true;
        s.source.s3.credentials_secret_ref = Some(SecretRef {
            name: "team-b-keys".into(),
        });
        s
    }

    #[test]
    fn a_pipeline_of_defaults_asks_for_nothing() {
        let defaults = BuildDefaults::default();
        assert!(required_rights(None, &spec(), &defaults).is_empty());
        let mut own_image = spec();
        own_image.decoders.image = Some(defaults.loader_image.clone());
        assert!(required_rights(None, &own_image, &defaults).is_empty());
    }

    #[test]
    fn every_field_that_reaches_a_pod_asks_for_its_right_on_create() {
        let rights = required_rights(None, &everything(), &BuildDefaults::default());
        assert_eq!(
            fields(&rights),
            [
                "decoders.image",
                "decoders.serviceAccountName",
                "decoders.tolerations",
                "source.s3.useInstanceMetadata",
                "source.s3.credentialsSecretRef",
            ]
        );
        let secret = rights.last().expect("secret right");
        assert_eq!(
            (secret.verb, secret.resource, secret.name.as_deref()),
            ("get", "secrets", Some("team-b-keys"))
        );
        assert!(
            rights[..4]
                .iter()
                .all(|r| (r.verb, r.resource) == ("create", "pods"))
        );
    }

    #[test]
    fn an_update_asks_only_for_what_it_changes() {
        let defaults = BuildDefaults::default();
        let old = everything();
        let mut scaled = old.clone();
        scaled.decoders.max_replicas += 1;
        assert!(required_rights(Some(&old), &scaled, &defaults).is_empty());
        let mut other_secret = old.clone();
        other_secret.source.s3.credentials_secret_ref = Some(SecretRef {
            name: "kube-keys".into(),
        });
        assert_eq!(
            fields(&required_rights(Some(&old), &other_secret, &defaults)),
            ["source.s3.credentialsSecretRef"]
        );
        let mut other_image = old.clone();
        other_image.decoders.image = Some("registry.example/custom:2".into());
        assert_eq!(
            fields(&required_rights(Some(&old), &other_image, &defaults)),
            ["decoders.image"]
        );
    }

    #[test]
    fn a_refusal_names_each_field_and_the_missing_right() {
        let rights = required_rights(None, &everything(), &BuildDefaults::default());
        let answered: Vec<(Right, Answer)> = rights
            .into_iter()
            .map(|r| {
                let answer = match r.field {
                    "decoders.image" => Answer::Denied,
                    "source.s3.credentialsSecretRef" => Answer::Unknown("timed out".into()),
                    _ => Answer::Allowed,
                };
                (r, answer)
            })
            .collect();
        assert_eq!(
            refusal("alice", "team-a", &answered).as_deref(),
            Some(
                "decoders.image: user alice may not create pods in namespace team-a; \
                 source.s3.credentialsSecretRef: could not check that user alice may get secret \"team-b-keys\" in namespace team-a (timed out); refused until it can be"
            )
        );
        let all_allowed: Vec<_> = answered
            .into_iter()
            .map(|(r, _)| (r, Answer::Allowed))
            .collect();
        assert_eq!(refusal("alice", "team-a", &all_allowed), None);
    }

    #[test]
    fn the_review_asks_as_the_requesting_user() {
        let user = UserInfo {
            username: Some("alice".into()),
            uid: Some("u-1".into()),
            groups: Some(vec!["team-a".into(), "system:authenticated".into()]),
            extra: Some(BTreeMap::from([("scopes".into(), vec!["x".into()])])),
        };
        let right = Right {
            field: "source.s3.credentialsSecretRef",
            verb: "get",
            resource: "secrets",
            name: Some("keys".into()),
        };
        let spec = access_review(&user, "team-a", &right).spec;
        assert_eq!(spec.user.as_deref(), Some("alice"));
        assert_eq!(spec.uid.as_deref(), Some("u-1"));
        assert_eq!(spec.groups, user.groups);
        assert_eq!(spec.extra, user.extra);
        let attrs = spec.resource_attributes.expect("resource attributes");
        assert_eq!(
            (
                attrs.namespace.as_deref(),
                attrs.verb.as_deref(),
                attrs.resource.as_deref(),
                attrs.name.as_deref()
            ),
            (Some("team-a"), Some("get"), Some("secrets"), Some("keys"))
        );
    }

    #[test]
    fn the_clusters_own_namespaces_take_no_pipeline() {
        for ns in RESERVED_NAMESPACES {
            assert!(namespace_refusal(ns).is_some_and(|m| m.starts_with("metadata.namespace")));
        }
        assert_eq!(namespace_refusal("team-a"), None);
    }
}
