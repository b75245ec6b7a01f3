//! The pipeline's identities and the least RBAC each needs.
//!
//! The loader sidecar runs as its own ServiceAccount per pipeline (`stoker-<pipeline>-sidecar`),
//! not the trainer's: it reads the pipeline's decoder pods to discover them and its own pod for
//! the local-decode share the autoscaler writes there (read only), and records Events on the
//! DataPipeline when its source refuses the samples. Projected service-account tokens are only
//! ever issued for the pod's own ServiceAccount, so the sidecar's token comes from a Secret of
//! type `kubernetes.io/service-account-token` that kube-controller-manager fills (token,
//! `ca.crt`, `namespace`) and the webhook mounts at the standard path in the sidecar container
//! only: the API server's ServiceAccount admission does not add the trainer's token to a
//! container that already mounts that path, and the trainer containers keep the trainer's own
//! ServiceAccount and token. Binding the Role to the trainer's ServiceAccount instead would give
//! the trainer's code, and every pod of that ServiceAccount (often `default`), the same reads.
//! The token is revoked with its Secret, which the pipeline owns.
//!
//! Decoders run as `decoders.serviceAccountName` when the pipeline names one (IRSA, workload
//! identity), else as a per-pipeline ServiceAccount with no permissions and no token mounted.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Secret, SecretVolumeSource, ServiceAccount, Volume, VolumeMount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::ResourceExt;

use super::{child_meta, sidecar_rbac_name};
use crate::api::DataPipeline;

/// The sidecar's ServiceAccount (the same name as its Role and RoleBinding).
pub fn sidecar_service_account_name(pipeline: &str) -> String {
    sidecar_rbac_name(pipeline)
}

/// The Secret holding the sidecar ServiceAccount's token.
pub fn sidecar_token_name(pipeline: &str) -> String {
    format!("{}-token", sidecar_rbac_name(pipeline))
}

/// The per-pipeline decoder ServiceAccount, used when the pipeline names none.
pub fn decoder_service_account_name(pipeline: &str) -> String {
    format!("stoker-{pipeline}-decoder")
}

/// The ServiceAccount decoder pods of `dp` run as.
pub fn decoder_service_account(dp: &DataPipeline) -> String {
    dp.spec
        .decoders
        .service_account_name
        .clone()
        .unwrap_or_else(|| decoder_service_account_name(&dp.name_any()))
}

/// Where Kubernetes clients look for the in-cluster token, CA and namespace.
pub const TOKEN_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The sidecar's token volume in the trainer pod.
pub const SIDECAR_TOKEN_VOLUME: &str = "stoker-sidecar-token";

pub fn sidecar_service_account(dp: &DataPipeline) -> ServiceAccount {
    ServiceAccount {
        metadata: child_meta(dp, sidecar_service_account_name(&dp.name_any())),
        // Only the sidecar uses this identity, through its token Secret; nothing mounts it
        // automatically.
        automount_service_account_token: Some(false),
        ..ServiceAccount::default()
    }
}

/// The sidecar's token Secret as the operator creates it: empty, kube-controller-manager's
/// token controller fills it. The operator only creates it and never reads it back.
pub fn sidecar_token_secret(dp: &DataPipeline) -> Secret {
    let mut metadata = child_meta(dp, sidecar_token_name(&dp.name_any()));
    metadata.annotations = Some(BTreeMap::from([(
        "kubernetes.io/service-account.name".to_string(),
        sidecar_service_account_name(&dp.name_any()),
    )]));
    Secret {
        metadata,
        type_: Some("kubernetes.io/service-account-token".to_string()),
        ..Secret::default()
    }
}

/// The default decoder ServiceAccount: no Role binds it, and no token is mounted.
pub fn decoder_service_account_object(dp: &DataPipeline) -> Option<ServiceAccount> {
    dp.spec
        .decoders
        .service_account_name
        .is_none()
        .then(|| ServiceAccount {
            metadata: child_meta(dp, decoder_service_account_name(&dp.name_any())),
            automount_service_account_token: Some(false),
            ..ServiceAccount::default()
        })
}

/// The trainer pod's volume with the sidecar's token, CA and namespace.
pub fn sidecar_token_volume(dp: &DataPipeline) -> Volume {
    Volume {
        name: SIDECAR_TOKEN_VOLUME.to_string(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(sidecar_token_name(&dp.name_any())),
            default_mode: Some(0o444),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The sidecar's mount of [`sidecar_token_volume`], where its Kubernetes client looks.
pub fn sidecar_token_mount() -> VolumeMount {
    VolumeMount {
        name: SIDECAR_TOKEN_VOLUME.to_string(),
        mount_path: TOKEN_MOUNT_PATH.to_string(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

pub fn sidecar_role(dp: &DataPipeline) -> Role {
    Role {
        metadata: child_meta(dp, sidecar_rbac_name(&dp.name_any())),
        rules: Some(vec![
            PolicyRule {
                // list/watch cannot be narrowed by label in RBAC; pods of this namespace only.
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods".to_string()]),
                verbs: vec!["get".to_string(), "list".to_string(), "watch".to_string()],
                ..PolicyRule::default()
            },
            PolicyRule {
                // A repeated Event is a patch of its series; Events cannot change anything else.
                api_groups: Some(vec!["events.k8s.io".to_string()]),
                resources: Some(vec!["events".to_string()]),
                verbs: vec!["create".to_string(), "patch".to_string()],
                ..PolicyRule::default()
            },
        ]),
    }
}

pub fn sidecar_role_binding(dp: &DataPipeline) -> RoleBinding {
    let name = sidecar_rbac_name(&dp.name_any());
    RoleBinding {
        metadata: child_meta(dp, name.clone()),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_string()),
            kind: "Role".to_string(),
            name,
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_string(),
            name: sidecar_service_account_name(&dp.name_any()),
            namespace: dp.namespace(),
            ..Subject::default()
        }]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dp() -> DataPipeline {
        serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
            .expect("fixture")
    }

    #[test]
    fn the_sidecar_reads_as_its_own_service_account() {
        let dp = dp();
        let binding = sidecar_role_binding(&dp);
        let subject = &binding.subjects.expect("subjects")[0];
        assert_eq!(subject.name, "stoker-qwen3vl-pretrain-sidecar");
        let sa = sidecar_service_account(&dp);
        assert_eq!(sa.metadata.name.as_deref(), Some(subject.name.as_str()));
        let secret = sidecar_token_secret(&dp);
        assert_eq!(
            secret.type_.as_deref(),
            Some("kubernetes.io/service-account-token")
        );
        assert_eq!(
            secret.metadata.annotations.expect("annotations")["kubernetes.io/service-account.name"],
            subject.name
        );
        assert!(secret.data.is_none(), "the token controller fills it");
        let volume = sidecar_token_volume(&dp);
        assert_eq!(
            volume.secret.and_then(|s| s.secret_name),
            secret.metadata.name
        );
        assert_eq!(sidecar_token_mount().mount_path, TOKEN_MOUNT_PATH);
    }

    #[test]
    fn decoders_get_a_permissionless_account_unless_the_pipeline_names_one() {
        let mut dp = dp();
        let sa = decoder_service_account_object(&dp).expect("default account");
        assert_eq!(
            sa.metadata.name.as_deref(),
            Some("stoker-qwen3vl-pretrain-decoder")
        );
        assert_eq!(sa.automount_service_account_token, Some(false));
        assert_eq!(
            decoder_service_account(&dp),
            "stoker-qwen3vl-pretrain-decoder"
        );
        dp.spec.decoders.service_account_name = Some("s3-reader".into());
        assert!(decoder_service_account_object(&dp).is_none());
        assert_eq!(decoder_service_account(&dp), "s3-reader");
    }
}
