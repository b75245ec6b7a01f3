//! What the network allows: each node's NIC utilization against its link speed, the rate one
//! decoder can move through its NIC, and the local-decode share that relieves a trainer node
//! whose own NIC limits delivery (more decoders cannot help there).

use std::collections::BTreeSet;

use super::demand::Demand;
use super::{AutoscalingPolicy, DecoderFleet, ScaleDecision, Signals, Snapshot};
use crate::autoscale::signals::NodeNetwork;

/// Bytes a NIC carries per payload byte: TCP/IP headers (~3.5% of a 1,500-byte frame), HTTP
/// and gRPC framing.
const WIRE_OVERHEAD: f64 = 1.05;
/// A local-decode share falls only by more than this, so that it does not follow noise.
const LOCAL_SHARE_BAND: f64 = 0.1;

impl Snapshot<'_> {
    /// The node's NIC utilization, with its link speed from node-exporter, else the node's
    /// `stoker.dev/nic-gbps` annotation, else the pipeline default.
    pub(super) fn nic_utilization(&self, node: &str) -> Option<f64> {
        let nic = self.signals.nodes.get(node)?;
        nic.utilization(self.link_of(node)?)
    }

    fn link_of(&self, node: &str) -> Option<f64> {
        self.signals
            .nodes
            .get(node)
            .and_then(|n| n.link_bytes_per_second)
            .or_else(|| self.fleet.node_link_bytes_per_second.get(node).copied())
            .or(self.policy.default_link_bytes_per_second)
    }

    /// Samples per second one decoder can move through its node's NIC at
    /// `max_nic_utilization`, over the largest link of the decoder-only nodes (new decoders
    /// avoid the hot ones), in the busier direction: decoded bytes out usually, encoded bytes
    /// in when the sources are large or the target small. `None` until something measures
    /// bytes per sample.
    pub(super) fn nic_rate_cap(&self) -> Option<f64> {
        let fleet = self.fleet;
        // A trainer's node also carries its own traffic: its bytes are not the decoders'.
        let decoder_nodes: BTreeSet<&str> = fleet
            .pods
            .values()
            .map(String::as_str)
            .filter(|node| !fleet.trainer_nodes.contains_key(*node))
            .collect();
        let link = decoder_nodes
            .iter()
            .filter_map(|node| self.link_of(node))
            .reduce(f64::max)
            .filter(|link| *link > 0.0)?;
        // The decoders' own counters first: a decoder that started inside the window is not
        // diluted by its node's idle seconds before it, as the node's NIC counters are.
        let per_sample = decoder_bytes_per_sample(self.signals)
            .or_else(|| nic_bytes_per_sample(fleet, self.signals, &decoder_nodes))?;
        Some(link * self.policy.max_nic_utilization / per_sample)
    }

    /// The share of `node`'s link that `pods`, its decoders, fill themselves in the busier
    /// direction; `None` without the decoders' byte counters.
    pub(super) fn decoder_link_share(&self, node: &str, pods: &[&str]) -> Option<f64> {
        let per_sample = decoder_bytes_per_sample(self.signals)?;
        let link = self.link_of(node).filter(|l| *l > 0.0)?;
        let samples: f64 = pods
            .iter()
            .filter_map(|pod| self.signals.decoders.get(*pod))
            .map(|signal| signal.samples_per_second)
            .sum();
        Some(samples * per_sample / link)
    }
}

/// Bytes the decoder-only nodes' NICs carried per sample their decoders delivered, in the busier
/// direction. `None` until those nodes have moved something.
fn nic_bytes_per_sample(
    fleet: &DecoderFleet,
    s: &Signals,
    decoder_nodes: &BTreeSet<&str>,
) -> Option<f64> {
    let samples: f64 = fleet
        .pods
        .iter()
        .filter(|(_, node)| decoder_nodes.contains(node.as_str()))
        .filter_map(|(pod, _)| s.decoders.get(pod))
        .map(|signal| signal.samples_per_second)
        .sum();
    let (received, sent) = decoder_nodes
        .iter()
        .filter_map(|node| s.nodes.get(*node))
        .fold((0.0, 0.0), |(rx, tx), nic| {
            (
                rx + nic.receive_bytes_per_second,
                tx + nic.transmit_bytes_per_second,
            )
        });
    let busier = f64::max(received, sent);
    (samples > 1.0 && busier > 0.0).then(|| busier / samples)
}

/// Bytes one sample costs a decoder's NIC in its busier direction (links are full duplex):
/// encoded bytes in from S3 or decoded bytes out to the trainers, with the wire's framing.
/// From the decoders' own counters, which cover the same series as their sample counts.
fn decoder_bytes_per_sample(s: &Signals) -> Option<f64> {
    let busier = f64::max(s.encoded_bytes_per_sample?, s.decoded_bytes_per_sample?);
    (busier > 0.0).then_some(busier * WIRE_OVERHEAD)
}

/// Trainer nodes whose NIC limits delivery, and the local-decode share that relieves them.
/// The condition lists them while local decode relieves them too; the returned node (the
/// first starving one) blocks scale-up.
pub(super) fn trainer_network(
    d: &mut ScaleDecision,
    snap: &Snapshot<'_>,
    demand: &Demand,
) -> Option<String> {
    let (policy, fleet, s) = (snap.policy, snap.fleet, snap.signals);
    let total: u32 = fleet.trainer_nodes.values().sum();
    let previous = snap.history.local_decode_share;
    let mut share: f64 = 0.0;
    let mut saturated = Vec::new();
    let mut relieved = Vec::new();
    for (node, trainers) in &fleet.trainer_nodes {
        let (Some(nic), Some(link)) = (s.nodes.get(node), snap.link_of(node)) else {
            continue;
        };
        let Some(util) = nic.utilization(link) else {
            continue;
        };
        let hot = util > policy.max_nic_utilization && demand.starved;
        if hot {
            saturated.push(node.clone());
        }
        if !hot && previous <= 0.0 {
            continue;
        }
        let part = f64::from(*trainers) / f64::from(total.max(1));
        let node_link = TrainerLink { nic, link, part };
        let Some(needed) = local_share_needed(policy, s, &node_link, demand, previous) else {
            continue;
        };
        if !hot && needed > 0.0 {
            // Relieved by local decode, still the bottleneck without it.
            relieved.push(node.clone());
        }
        share = share.max(needed);
    }
    let mut share = share.clamp(0.0, policy.max_local_decode_share);
    if share < previous && previous - share < LOCAL_SHARE_BAND {
        share = previous;
    }
    d.local_decode_share = share;
    let blocking = saturated.first().cloned();
    saturated.extend(relieved);
    saturated.sort();
    d.conditions.network_saturated = saturated;
    blocking
}

/// One trainer node's NIC.
struct TrainerLink<'a> {
    nic: &'a NodeNetwork,
    /// Link speed in bytes per second.
    link: f64,
    /// The node's part (0..=1) of the trainers.
    part: f64,
}

/// The share of its trainers' work the node's sidecars must decode themselves for its NIC to
/// carry the rest at the limit; `None` when nothing measures it.
fn local_share_needed(
    policy: &AutoscalingPolicy,
    s: &Signals,
    node: &TrainerLink<'_>,
    demand: &Demand,
    previous: f64,
) -> Option<f64> {
    let node_demand = demand.samples_per_second * node.part;
    let capacity = policy.max_nic_utilization * node.link;
    match (s.decoded_bytes_per_sample, s.encoded_bytes_per_sample) {
        (Some(out), Some(inp)) if out > inp && node_demand > 0.0 => {
            Some((node_demand * out - capacity) / (node_demand * (out - inp)))
        }
        // Without the decoders' byte counts: take the bytes per sample the NIC carries now
        // as the network share's, and local decode as nearly free on the wire.
        _ => {
            let delivered = demand.consumption * node.part;
            if delivered <= 0.0 || node_demand <= 0.0 || previous >= 1.0 {
                return None;
            }
            let per_sample = node.nic.receive_bytes_per_second / delivered / (1.0 - previous);
            Some(1.0 - capacity / (node_demand * per_sample))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{ScaleHistory, decide};
    use std::collections::BTreeMap;

    #[test]
    fn the_nic_caps_a_decoders_rate() {
        check(vec![
            Case {
                name: "NIC-bound decoder: its rate is what the busier direction carries",
                policy: one_decoder(),
                fleet: fleet(1, 1),
                signals: Some(nic_bound(true)),
                replicas: 7,
                starved: true,
                avoid: &["cpu-0"],
                reason: "need 109/s at 22/s per decoder → 7; node cpu-0 NIC 97% > 80%: each of its 1 decoders carries 111% alone, moving cannot help",
                ..Case::default()
            },
            Case {
                name: "NIC-bound decoder without byte counters: the node's busier direction",
                policy: one_decoder(),
                fleet: fleet(1, 1),
                signals: Some(nic_bound(false)),
                replicas: 6,
                starved: true,
                avoid: &["cpu-0"],
                reason: "need 109/s at 25/s per decoder → 6",
                ..Case::default()
            },
        ]);
    }

    /// 16 decoders only 59% busy while the 10 Gb/s trainer NIC runs at 95%.
    fn hot_trainer_node() -> crate::autoscale::signals::Signals {
        let mut s = signals(16, 0.587, 0.3);
        s.consumption_per_second = Some(0.95 * gbps_to_bytes_per_second(10.0) / DECODED);
        s.nodes = BTreeMap::from([(GPU_NODE.to_string(), nic(0.95, 10.0))]);
        s
    }

    #[test]
    fn a_saturated_trainer_node_decodes_locally() {
        check(vec![Case {
            name: "the trainer node's NIC is the bottleneck: no scale-up, local decode",
            signals: Some(hot_trainer_node()),
            fleet: fleet(16, 8),
            replicas: 16,
            starved: true,
            network_saturated: &[GPU_NODE],
            avoid: &[GPU_NODE],
            reason: "trainer node gpu-1 NIC above 80%: more decoders cannot help; local decode 49%",
            ..Case::default()
        }]);
    }

    #[test]
    fn local_decode_share_relieves_the_trainer_nic_to_its_limit() {
        let link = gbps_to_bytes_per_second(10.0);
        let d = decide(
            &policy(),
            &fleet(16, 8),
            Some(&hot_trainer_node()),
            &ScaleHistory::default(),
            at(0),
        );
        let demand = 0.95 * link / DECODED / 0.7;
        let wire =
            demand * ((1.0 - d.local_decode_share) * DECODED + d.local_decode_share * ENCODED);
        assert!(
            (wire / link - 0.8).abs() < 0.01,
            "NIC after the shift: {}",
            wire / link
        );
    }
}
