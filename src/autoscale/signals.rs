//! What the autoscaler reads about one pipeline over one window. Plain data: `prometheus.rs`
//! fills it, `policy.rs` and the simulation read it.

use std::collections::BTreeMap;
use std::time::Duration;

/// One pipeline's signals over the autoscaler's window. `None` means the series was absent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Signals {
    /// Share (0..=1) of wall time the trainers were blocked waiting for the next batch, as the
    /// rank that gates the step saw it: [`gating_data_wait`] of the per-rank shares.
    pub data_wait_share: Option<f64>,
    /// Samples per second the sidecars handed to their trainers, all trainers together.
    pub consumption_per_second: Option<f64>,
    /// Trainer ranks that reported in the window.
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

/// The data wait that gates a synchronous step, from each rank's share (0..=1): the highest
/// once the single worst rank is set aside, i.e. the highest two ranks see; with one rank, its
/// own. Non-finite shares (a rate over no samples) are left out; `None` when none is left.
///
/// The most starved rank sets every rank's step time, so a mean hides it: one starving node of
/// 16 (8 of 128 ranks at 54%) averaged 3.4% in `tests/autoscale_simulation.rs` and left the
/// GPUs 46% busy. Yet one rank at 100% is a wedged sidecar or a restarting trainer that no
/// decoder feeds: on it the max took a fed fleet from 15 decoders to maxReplicas (40). Ranks
/// starve together (a node's eight), so the second highest sees them at any world size, where
/// a 0.9 quantile read that node as 0%.
pub fn gating_data_wait(per_rank: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (mut worst, mut second): (Option<f64>, Option<f64>) = (None, None);
    for wait in per_rank.into_iter().filter(|w| w.is_finite()) {
        if worst.is_none_or(|w| wait > w) {
            second = worst;
            worst = Some(wait);
        } else if second.is_none_or(|s| wait > s) {
            second = Some(wait);
        }
    }
    second.or(worst)
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

#[cfg(test)]
mod tests {
    use super::gating_data_wait;

    #[test]
    fn the_gating_wait_sets_the_single_worst_rank_aside() {
        let cases: &[(&str, &[f64], Option<f64>)] = &[
            ("no ranks", &[], None),
            ("one rank: its own", &[0.3], Some(0.3)),
            ("two ranks: both must wait", &[0.3, 0.02], Some(0.02)),
            (
                "one stuck rank of 8 is set aside",
                &[0.01, 0.01, 0.01, 1.0, 0.01, 0.01, 0.01, 0.01],
                Some(0.01),
            ),
            (
                "a starved node's ranks are not",
                &[0.0, 0.0, 0.54, 0.54, 0.54, 0.0, 0.54],
                Some(0.54),
            ),
            (
                "a stuck rank beside a starved node",
                &[0.0, 0.2, 1.0, 0.2, 0.0],
                Some(0.2),
            ),
            (
                "a rate over no samples is left out",
                &[f64::NAN, 0.4, 0.1],
                Some(0.1),
            ),
            ("only NaN", &[f64::NAN], None),
        ];
        for (name, waits, expected) in cases {
            assert_eq!(gating_data_wait(waits.iter().copied()), *expected, "{name}");
        }
    }
}

/// What to read: one pipeline over one window.
#[derive(Clone, Debug, PartialEq)]
pub struct SignalScope {
    pub namespace: String,
    pub pipeline: String,
    pub trainer_pods: Vec<String>,
    /// Nodes running the pipeline's decoders or trainers.
    pub nodes: Vec<String>,
    pub window: Duration,
}
