//! What the autoscaler reads about one pipeline over one window. Plain data: `prometheus.rs`
//! fills it, `policy.rs` and the simulation read it.

use std::collections::BTreeMap;

/// One pipeline's signals over the autoscaler's window. `None` means the series was absent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Signals {
    /// Mean share (0..=1) of wall time the trainers were blocked waiting for the next batch.
    pub data_wait_share: Option<f64>,
    /// Samples per second the sidecars handed to their trainers, all trainers together.
    pub consumption_per_second: Option<f64>,
    /// Sidecars that reported in the window.
    pub trainers_reporting: Option<u32>,
    /// Mean GPU utilization of the trainer pods (dcgm-exporter); absent without it.
    pub gpu_utilization_percent: Option<f64>,
    /// Per decoder pod, by pod name.
    pub decoders: BTreeMap<String, DecoderSignal>,
    /// Per node, by node name.
    pub nodes: BTreeMap<String, NodeNetwork>,
    /// S3 answers asking the decoders to slow down (503 SlowDown, 429), per second.
    pub s3_throttles_per_second: Option<f64>,
    /// S3 requests the decoders sent, per second (every attempt).
    pub s3_requests_per_second: Option<f64>,
    /// Decoded bytes a decoder sends per sample: what crosses the trainer node's NIC.
    pub decoded_bytes_per_sample: Option<f64>,
    /// Encoded bytes read from S3 per sample: what local decode pulls through that NIC instead.
    pub encoded_bytes_per_sample: Option<f64>,
}

/// One decoder pod.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecoderSignal {
    pub samples_per_second: f64,
    /// Share (0..=1) of its decode threads' time spent decoding, resizing and packing.
    pub busy_share: f64,
}

/// One node's network interface.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeNetwork {
    pub receive_bytes_per_second: f64,
    pub transmit_bytes_per_second: f64,
    /// Link speed as node-exporter reports it; `None` when it does not.
    pub link_bytes_per_second: Option<f64>,
}

impl NodeNetwork {
    /// Utilization (0..) of the busier direction: links are full duplex.
    pub fn utilization(&self, link_bytes_per_second: f64) -> Option<f64> {
        (link_bytes_per_second > 0.0).then(|| {
            self.receive_bytes_per_second
                .max(self.transmit_bytes_per_second)
                / link_bytes_per_second
        })
    }
}

/// Bytes per second of a link of `gbps` gigabits per second.
pub fn gbps_to_bytes_per_second(gbps: f64) -> f64 {
    gbps * 1e9 / 8.0
}
