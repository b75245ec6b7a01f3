//! A headless Service over the serving decoders (DNS and Prometheus discovery).

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use stoker_contract::{DECODER_GRPC_PORT, DECODER_METRICS_PORT};

use super::{child_meta, decoder_selector_labels, decoder_service_name};
use crate::api::{DataPipeline, LABEL_DRAINING};

pub fn decoder_service(dp: &DataPipeline) -> Service {
    let mut selector = decoder_selector_labels(&dp.name_any());
    // Draining decoders leave the Service before they are deleted.
    selector.insert(LABEL_DRAINING.to_string(), "false".to_string());
    let port = |name: &str, port: u16| ServicePort {
        name: Some(name.to_string()),
        port: i32::from(port),
        target_port: Some(IntOrString::String(name.to_string())),
        protocol: Some("TCP".to_string()),
        ..ServicePort::default()
    };
    Service {
        metadata: child_meta(dp, decoder_service_name(dp)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_string()),
            selector: Some(selector),
            ports: Some(vec![
                port("grpc", DECODER_GRPC_PORT),
                port("metrics", DECODER_METRICS_PORT),
            ]),
            publish_not_ready_addresses: Some(false),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
