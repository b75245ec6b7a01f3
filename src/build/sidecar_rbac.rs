//! The least RBAC the loader sidecar needs: read the pipeline's decoder pods to discover them,
//! and its own pod for the local-decode share the autoscaler writes there (read only: no
//! write); record Events on the DataPipeline when its source refuses the samples.

use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::ResourceExt;

use super::{child_meta, sidecar_rbac_name};
use crate::api::DataPipeline;

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
            name: dp.spec.trainer.service_account_name.clone(),
            namespace: dp.namespace(),
            ..Subject::default()
        }]),
    }
}
