//! The simulated nodes every test cluster has: GPU nodes for trainers and CPU nodes, over two
//! zones, for decoders. KWOK keeps them Ready and runs their pods' lifecycle.

use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;
use std::collections::BTreeMap;

/// Label every simulated node carries: `cpu` or `gpu`.
pub const POOL_LABEL: &str = "stoker.dev/pool";
/// Annotation with the node's NIC speed in Gb/s; the autoscaler reads it as the link speed.
pub const NIC_GBPS_ANNOTATION: &str = "stoker.dev/nic-gbps";
/// The taint on GPU nodes, as on most GPU clusters.
pub const GPU_TAINT_KEY: &str = "nvidia.com/gpu";
pub const ZONES: [&str; 2] = ["zone-a", "zone-b"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pool {
    Cpu,
    Gpu,
}

#[derive(Clone, Debug)]
pub struct SimNode {
    pub name: String,
    pub pool: Pool,
    pub zone: &'static str,
    pub instance_type: &'static str,
    pub cpu: u32,
    pub memory_gi: u32,
    pub gpus: u32,
    pub nic_gbps: u32,
}

/// 4 GPU nodes (8 GPUs each) and 8 CPU nodes, half of each in each zone, 25 Gb/s NICs.
pub fn default_nodes() -> Vec<SimNode> {
    let gpu = (0..4).map(|i| SimNode {
        name: format!("gpu-{i}"),
        pool: Pool::Gpu,
        zone: ZONES[i % 2],
        instance_type: "p5.48xlarge",
        cpu: 192,
        memory_gi: 2048,
        gpus: 8,
        nic_gbps: 25,
    });
    let cpu = (0..8).map(|i| SimNode {
        name: format!("cpu-{i}"),
        pool: Pool::Cpu,
        zone: ZONES[i % 2],
        instance_type: "c7i.8xlarge",
        cpu: 32,
        memory_gi: 64,
        gpus: 0,
        nic_gbps: 25,
    });
    gpu.chain(cpu).collect()
}

impl SimNode {
    /// The Node object KWOK will manage (selected by the `kwok.x-k8s.io/node: fake` annotation).
    pub fn to_node(&self) -> Node {
        let pool = match self.pool {
            Pool::Cpu => "cpu",
            Pool::Gpu => "gpu",
        };
        let labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_string(), self.name.clone()),
            ("kubernetes.io/os".to_string(), "linux".to_string()),
            ("kubernetes.io/arch".to_string(), "amd64".to_string()),
            (
                "topology.kubernetes.io/zone".to_string(),
                self.zone.to_string(),
            ),
            (
                "node.kubernetes.io/instance-type".to_string(),
                self.instance_type.to_string(),
            ),
            (POOL_LABEL.to_string(), pool.to_string()),
            ("type".to_string(), "kwok".to_string()),
        ]);
        let annotations = BTreeMap::from([
            ("kwok.x-k8s.io/node".to_string(), "fake".to_string()),
            (NIC_GBPS_ANNOTATION.to_string(), self.nic_gbps.to_string()),
        ]);
        let mut resources = BTreeMap::from([
            ("cpu".to_string(), Quantity(self.cpu.to_string())),
            (
                "memory".to_string(),
                Quantity(format!("{}Gi", self.memory_gi)),
            ),
            ("pods".to_string(), Quantity("110".to_string())),
        ]);
        if self.gpus > 0 {
            resources.insert(
                "nvidia.com/gpu".to_string(),
                Quantity(self.gpus.to_string()),
            );
        }
        let taints = (self.pool == Pool::Gpu).then(|| {
            vec![Taint {
                key: GPU_TAINT_KEY.to_string(),
                value: Some("present".to_string()),
                effect: "NoSchedule".to_string(),
                ..Default::default()
            }]
        });
        Node {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(labels),
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints,
                ..Default::default()
            }),
            status: Some(NodeStatus {
                capacity: Some(resources.clone()),
                allocatable: Some(resources),
                ..Default::default()
            }),
        }
    }
}
