//! The decoder fleet: which pods to create, take out of discovery, and delete. Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::api::v1alpha1::{AutoscalingMode, DataPipelineSpec, DecoderFleetStatus};
use crate::api::{ANNOTATION_DRAIN_STARTED, LABEL_DRAINING};

/// The number of decoders the pipeline should run now. `recommended` is the autoscaler's
/// answer when it has one; until then (and in `recommend` mode) the fleet holds minReplicas.
pub fn desired_replicas(spec: &DataPipelineSpec, recommended: Option<i32>) -> i32 {
    let d = &spec.decoders;
    match spec.autoscaling.mode {
        AutoscalingMode::Off => spec.autoscaling.replicas.unwrap_or(d.min_replicas),
        AutoscalingMode::Recommend => d.min_replicas,
        AutoscalingMode::Auto => recommended
            .unwrap_or(d.min_replicas)
            .clamp(d.min_replicas, d.max_replicas.max(d.min_replicas)),
    }
}

/// What one reconcile does to the decoder pods.
#[derive(Debug, Default, PartialEq)]
pub struct FleetPlan {
    /// New decoders to create.
    pub create: usize,
    /// Serving decoders to take out of discovery (label `stoker.dev/draining=true`).
    pub drain: Vec<String>,
    /// Pods to delete: drained long enough, or failed.
    pub delete: Vec<String>,
    /// Of `delete`, the failed ones (they are replaced).
    pub failed: usize,
    /// When to look again for a drain that is still running.
    pub requeue_after: Option<Duration>,
}

/// One decoder pod as the fleet sees it.
#[derive(Debug)]
struct Member<'a> {
    pod: &'a Pod,
    ready: bool,
    node: Option<&'a str>,
}

pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn is_failed(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    )
}

pub fn is_draining(pod: &Pod) -> bool {
    pod.labels().get(LABEL_DRAINING).map(String::as_str) == Some("true")
}

fn drain_started(pod: &Pod) -> Option<Timestamp> {
    pod.annotations()
        .get(ANNOTATION_DRAIN_STARTED)
        .and_then(|s| s.parse().ok())
}

/// Plans the fleet: replace failed pods, finish drains, then add or drain to reach `desired`.
/// Scale-down takes not-ready pods first, then pods on the most crowded node, then the newest.
pub fn plan(pods: &[Pod], desired: usize, drain_seconds: u32, now: Timestamp) -> FleetPlan {
    let mut plan = FleetPlan::default();
    let mut serving: Vec<Member<'_>> = Vec::new();
    for pod in pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()) {
        if is_failed(pod) {
            plan.delete.push(pod.name_any());
            plan.failed += 1;
        } else if is_draining(pod) {
            let elapsed = drain_started(pod)
                .map(|t| now.duration_since(t).as_secs_f64())
                .unwrap_or(f64::MAX);
            let left = f64::from(drain_seconds) - elapsed;
            if left <= 0.0 {
                plan.delete.push(pod.name_any());
            } else {
                let wait = Duration::from_secs_f64(left);
                plan.requeue_after = Some(plan.requeue_after.map_or(wait, |w| w.min(wait)));
            }
        } else {
            serving.push(Member {
                pod,
                ready: is_ready(pod),
                node: pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            });
        }
    }
    if serving.len() < desired {
        plan.create = desired - serving.len();
    }
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &serving {
        if let Some(n) = m.node {
            *per_node.entry(n).or_default() += 1;
        }
    }
    while serving.len() > desired {
        let pick = serving
            .iter()
            .enumerate()
            .max_by(|(_, a), (_, b)| {
                let crowd = |m: &Member<'_>| m.node.and_then(|n| per_node.get(n)).copied();
                (!a.ready)
                    .cmp(&!b.ready)
                    .then(crowd(a).cmp(&crowd(b)))
                    .then(
                        a.pod
                            .metadata
                            .creation_timestamp
                            .cmp(&b.pod.metadata.creation_timestamp),
                    )
                    .then(a.pod.name_any().cmp(&b.pod.name_any()))
            })
            .map(|(i, _)| i);
        let Some(i) = pick else { break };
        let gone = serving.swap_remove(i);
        if let Some(n) = gone.node.and_then(|n| per_node.get_mut(n)) {
            *n -= 1;
        }
        plan.drain.push(gone.pod.name_any());
    }
    if !plan.drain.is_empty() && drain_seconds > 0 {
        let wait = Duration::from_secs(u64::from(drain_seconds));
        plan.requeue_after = Some(plan.requeue_after.map_or(wait, |w| w.min(wait)));
    }
    plan
}

/// The fleet's status block.
pub fn fleet_status(pods: &[Pod], desired: i32) -> DecoderFleetStatus {
    let live = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && !is_failed(p));
    let mut ready = 0;
    let mut draining = 0;
    let mut nodes = BTreeSet::new();
    for p in live {
        if is_draining(p) {
            draining += 1;
        } else if is_ready(p) {
            ready += 1;
            if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                nodes.insert(n.to_string());
            }
        }
    }
    DecoderFleetStatus {
        desired,
        ready,
        draining,
        nodes: i32::try_from(nodes.len()).unwrap_or(i32::MAX),
    }
}
