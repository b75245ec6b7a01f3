//! Where decoders run: new decoders avoid nodes whose NIC is above the limit, and decoders
//! move off a node they push past it, when moving can help.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorTerm, Pod};
use k8s_openapi::jiff::Timestamp;

use super::reason::pct;
use super::windows::{elapsed, settle_seconds};
use super::{AutoscalingPolicy, ScaleDecision, Snapshot};

/// Nodes to avoid and decoders to move: enough of a hot node's decoders that its NIC falls
/// back under the limit, assuming its traffic is theirs. Returns what it did, for the reason.
pub(super) fn place(d: &mut ScaleDecision, snap: &Snapshot<'_>) -> Vec<String> {
    let limit = snap.policy.max_nic_utilization;
    let mut on_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (pod, node) in &snap.fleet.pods {
        on_node.entry(node.as_str()).or_default().push(pod.as_str());
    }
    let mut moved = Vec::new();
    let mut notes = Vec::new();
    for node in snap.signals.nodes.keys() {
        let Some(util) = snap.nic_utilization(node) else {
            continue;
        };
        if util <= limit {
            continue;
        }
        d.avoid_nodes.push(node.clone());
        let Some(pods) = on_node.get(node.as_str()) else {
            continue;
        };
        let hot = HotNode { node, pods, util };
        let what = match decoders_to_move(snap, &hot) {
            Ok(k) => {
                d.learned.moved_from.push(node.clone());
                // The last by name: with generated names that is arbitrary but stable between
                // calls.
                moved.extend(pods.iter().rev().take(k).map(|p| p.to_string()));
                format!("moving {k} of {} decoders", pods.len())
            }
            Err(why) => why,
        };
        notes.push(format!(
            "node {node} NIC {} > {}: {what}",
            pct(util),
            pct(limit)
        ));
    }
    moved.sort();
    d.move_pods = moved;
    notes
}

/// A node whose NIC is above the limit, and the pipeline's decoders on it.
struct HotNode<'a> {
    node: &'a str,
    pods: &'a [&'a str],
    /// NIC utilization (0..) of its busier direction.
    util: f64,
}

/// How many of a hot node's decoders to move; `Err` says why none.
fn decoders_to_move(snap: &Snapshot<'_>, hot: &HotNode<'_>) -> Result<usize, String> {
    let (policy, now) = (snap.policy, snap.now);
    let limit = policy.max_nic_utilization;
    // The window still holds traffic of the decoders moved last time: wait until it
    // shows the node without them, or every look would move more.
    let cooling = snap
        .history
        .moved_at
        .get(hot.node)
        .is_some_and(|t| elapsed(*t, now) < settle_seconds(policy));
    if cooling {
        return Err("waiting for the last move to show".to_string());
    }
    let n = hot.pods.len();
    // Moving shifts the moved decoders' traffic to another node. That helps when decoders
    // share a node (the spread is uneven) or when other traffic fills it; a lone decoder
    // that is the node's traffic, or one that fills the limit on its own, would fill its
    // new node the same: the cure is more decoders (their rate is capped by the NIC).
    let own = snap
        .decoder_link_share(hot.node, hot.pods)
        .unwrap_or(hot.util);
    let alone = own / n as f64;
    let others = (hot.util - own).max(0.0);
    if alone > limit {
        return Err(format!(
            "each of its {n} decoders carries {} alone, moving cannot help",
            pct(alone)
        ));
    }
    if n == 1 && others <= limit {
        return Err(format!(
            "its decoder is most of its traffic (others {}), moving cannot help",
            pct(others)
        ));
    }
    Ok(((n as f64) * (1.0 - limit / hot.util))
        .ceil()
        .clamp(1.0, n as f64) as usize)
}

/// Remembers when decoders were moved off a node, for as long as the window shows their
/// traffic there.
pub(super) fn remember_moves(
    moved_at: &mut BTreeMap<String, Timestamp>,
    decision: &ScaleDecision,
    policy: &AutoscalingPolicy,
    now: Timestamp,
) {
    let settle = settle_seconds(policy);
    moved_at.retain(|_, t| elapsed(*t, now) < settle);
    for node in &decision.learned.moved_from {
        moved_at.insert(node.clone(), now);
    }
}

/// Keeps a new decoder off `avoid` nodes (their NIC is past the limit). Added to each new pod,
/// not to the template, so that a change of the list never rolls healthy decoders.
pub fn keep_off(pod: &mut Pod, avoid: &[String]) {
    if avoid.is_empty() {
        return;
    }
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    let term = serde_json::json!({
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": avoid}]
    });
    let affinity = spec.affinity.get_or_insert_with(Default::default);
    let node = affinity.node_affinity.get_or_insert_with(Default::default);
    let required = node
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(Default::default);
    let Ok(term) = serde_json::from_value::<NodeSelectorTerm>(term) else {
        return;
    };
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(term);
    } else {
        // Terms are ORed; the expression must hold in each of them.
        for existing in &mut required.node_selector_terms {
            existing
                .match_expressions
                .get_or_insert_with(Vec::new)
                .extend(term.match_expressions.clone().unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn hot_decoder_nodes_are_avoided_and_moved_off_when_it_helps() {
        let mut hot_decoder_node = signals(6, 0.9, 0.02);
        hot_decoder_node.nodes = BTreeMap::from([
            ("cpu-0".to_string(), nic(0.3, 25.0)),
            ("cpu-1".to_string(), nic(0.95, 25.0)),
            ("cpu-2".to_string(), nic(0.3, 25.0)),
        ]);
        // The same node as in `nic_bound`, but its decoder moves only 2/s: other traffic
        // fills the NIC.
        let mut quiet_nic_bound = nic_bound(true);
        if let Some(decoder) = quiet_nic_bound.decoders.get_mut(&pod(0)) {
            decoder.samples_per_second = 2.0;
        }
        // A lone decoder at 14/s (30% of the link) on a node at 97%: others 67%, under the
        // limit; moving it would only carry its traffic elsewhere.
        let mut busy_lone = nic_bound(true);
        if let Some(decoder) = busy_lone.decoders.get_mut(&pod(0)) {
            decoder.samples_per_second = 8.0;
        }
        check(vec![
            Case {
                name: "a decoder node's NIC above the limit: avoid it, move decoders off",
                signals: Some(hot_decoder_node),
                fleet: fleet(6, 8),
                replicas: 6,
                avoid: &["cpu-1"],
                moved: &["decoder-04"],
                reason: "node cpu-1 NIC 95% > 80%: moving 1 of 2 decoders",
                ..Case::default()
            },
            Case {
                name: "a lone decoder on a node others fill: moved off",
                policy: one_decoder(),
                fleet: fleet(1, 1),
                signals: Some(quiet_nic_bound),
                replicas: 7,
                starved: true,
                avoid: &["cpu-0"],
                moved: &["decoder-00"],
                reason: "node cpu-0 NIC 97% > 80%: moving 1 of 1 decoders",
                ..Case::default()
            },
            Case {
                name: "a lone decoder that is most of its node's traffic: not moved",
                policy: one_decoder(),
                fleet: fleet(1, 1),
                signals: Some(busy_lone),
                replicas: 7,
                starved: true,
                avoid: &["cpu-0"],
                reason: "node cpu-0 NIC 97% > 80%: its decoder is most of its traffic (others 67%), moving cannot help",
                ..Case::default()
            },
        ]);
    }

    fn decoder_pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "d"},
            "spec": {"containers": [{"name": "c"}]}
        }))
        .expect("pod")
    }

    #[test]
    fn new_decoders_keep_off_hot_nodes() {
        let mut p = decoder_pod();
        keep_off(&mut p, &["cpu-0".to_string(), "cpu-3".to_string()]);
        let terms = p
            .spec
            .unwrap()
            .affinity
            .unwrap()
            .node_affinity
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .unwrap()
            .node_selector_terms;
        assert_eq!(terms.len(), 1);
        let expr = &terms[0].match_expressions.as_ref().unwrap()[0];
        assert_eq!(expr.key, "kubernetes.io/hostname");
        assert_eq!(expr.operator, "NotIn");
        assert_eq!(
            expr.values.as_deref(),
            Some(&["cpu-0".to_string(), "cpu-3".to_string()][..])
        );
    }

    #[test]
    fn nothing_to_avoid_leaves_the_pod_alone() {
        let mut p = decoder_pod();
        keep_off(&mut p, &[]);
        assert!(p.spec.unwrap().affinity.is_none());
    }
}
