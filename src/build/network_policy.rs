//! Decoders accept batch requests only from the pipeline's own trainer pods.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use stoker_contract::{DECODER_GRPC_PORT, DECODER_METRICS_PORT};

use super::{child_meta, decoder_selector_labels, network_policy_name};
use crate::api::{DataPipeline, LABEL_PIPELINE, LABEL_ROLE, ROLE_TRAINER};

pub fn network_policy(dp: &DataPipeline) -> NetworkPolicy {
    let name = dp.name_any();
    let port = |p: u16| NetworkPolicyPort {
        port: Some(IntOrString::Int(i32::from(p))),
        protocol: Some("TCP".to_string()),
        ..NetworkPolicyPort::default()
    };
    let trainers = NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([
                (LABEL_PIPELINE.to_string(), name.clone()),
                (LABEL_ROLE.to_string(), ROLE_TRAINER.to_string()),
            ])),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    };
    NetworkPolicy {
        metadata: child_meta(dp, network_policy_name(dp)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(decoder_selector_labels(&name)),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".to_string()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![trainers]),
                    ports: Some(vec![port(DECODER_GRPC_PORT)]),
                },
                // Metrics carry no data; Prometheus may run anywhere in the cluster.
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![port(DECODER_METRICS_PORT)]),
                },
            ]),
            ..NetworkPolicySpec::default()
        }),
    }
}
