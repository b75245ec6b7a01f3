//! The decoder fleet: which pods to create, take out of discovery, and delete. Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::api::v1alpha1::DecoderFleetStatus;
use crate::api::{ANNOTATION_DRAIN_STARTED, LABEL_DRAINING, LABEL_TEMPLATE_HASH};

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
    /// Built from an older pod spec (image, resources, placement changed since).
    stale: bool,
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
/// Scale-down takes not-ready pods first, then pods built from an older spec, then pods on the
/// most crowded node, then the newest. When the pod spec changed (`template_hash`), a settled
/// fleet replaces one stale decoder at a time: drain it and create its successor together, and
/// move on only when every serving decoder is ready again.
pub fn plan(
    pods: &[Pod],
    desired: usize,
    template_hash: &str,
    drain_seconds: u32,
    now: Timestamp,
) -> FleetPlan {
    let mut plan = FleetPlan::default();
    let mut serving: Vec<Member<'_>> = Vec::new();
    for pod in pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
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
                stale: pod.labels().get(LABEL_TEMPLATE_HASH).map(String::as_str)
                    != Some(template_hash),
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
    let rolling = serving.len() == desired
        && plan.create == 0
        && serving.iter().all(|m| m.ready)
        && serving.iter().any(|m| m.stale);
    let target = if rolling { desired - 1 } else { desired };
    if rolling {
        plan.create = 1;
    }
    while serving.len() > target {
        let pick = serving
            .iter()
            .enumerate()
            .max_by(|(_, a), (_, b)| {
                let crowd = |m: &Member<'_>| m.node.and_then(|n| per_node.get(n)).copied();
                (!a.ready)
                    .cmp(&!b.ready)
                    .then(a.stale.cmp(&b.stale))
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use std::collections::BTreeMap;

    const HASH: &str = "h1";

    fn plan(pods: &[Pod], desired: usize, drain_seconds: u32, now: Timestamp) -> FleetPlan {
        super::plan(pods, desired, HASH, drain_seconds, now)
    }

    fn stale(mut p: Pod) -> Pod {
        p.labels_mut()
            .insert(LABEL_TEMPLATE_HASH.into(), "h0".into());
        p
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("valid")
    }

    fn pod(name: &str, node: Option<&str>, ready: bool, created: i64) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                creation_timestamp: Some(Time(t(created))),
                labels: Some(BTreeMap::from([
                    (LABEL_DRAINING.into(), "false".into()),
                    (LABEL_TEMPLATE_HASH.into(), HASH.into()),
                ])),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(Into::into),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    fn draining(mut p: Pod, since: i64) -> Pod {
        p.labels_mut().insert(LABEL_DRAINING.into(), "true".into());
        p.annotations_mut()
            .insert(ANNOTATION_DRAIN_STARTED.into(), t(since).to_string());
        p
    }

    #[test]
    fn creates_up_to_desired() {
        let pods = vec![pod("a", Some("n1"), true, 0)];
        let p = plan(&pods, 4, 30, t(100));
        assert_eq!(p.create, 3);
        assert!(p.drain.is_empty() && p.delete.is_empty());
    }

    #[test]
    fn steady_state_changes_nothing() {
        let pods = vec![pod("a", Some("n1"), true, 0), pod("b", Some("n2"), true, 0)];
        assert_eq!(plan(&pods, 2, 30, t(100)), FleetPlan::default());
    }

    #[test]
    fn scale_down_drains_not_ready_then_crowded_then_newest() {
        let pods = vec![
            pod("old-n1", Some("n1"), true, 0),
            pod("new-n1", Some("n1"), true, 50),
            pod("n2", Some("n2"), true, 60),
            pod("n3", Some("n3"), true, 70),
            pod("sick", Some("n3"), false, 1),
        ];
        let p = plan(&pods, 2, 30, t(100));
        // Not ready first; then n1 (two pods) loses its newest; then the newest of the rest.
        assert_eq!(p.drain, vec!["sick", "new-n1", "n3"]);
        assert_eq!(p.create, 0);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
    }

    #[test]
    fn drained_pods_are_deleted_after_the_grace_period() {
        let pods = vec![
            draining(pod("done", Some("n1"), true, 0), 0),
            draining(pod("waiting", Some("n2"), true, 0), 90),
            pod("serving", Some("n3"), true, 0),
        ];
        let p = plan(&pods, 1, 30, t(100));
        assert_eq!(p.delete, vec!["done"]);
        assert!(p.drain.is_empty());
        assert_eq!(
            p.create, 0,
            "draining pods do not count as serving, nor block scale-up"
        );
        assert_eq!(p.requeue_after, Some(Duration::from_secs(20)));
    }

    #[test]
    fn failed_pods_are_replaced() {
        let mut failed = pod("failed", Some("n1"), false, 0);
        failed.status.as_mut().expect("status").phase = Some("Failed".into());
        let pods = vec![failed, pod("ok", Some("n2"), true, 0)];
        let p = plan(&pods, 2, 30, t(100));
        assert_eq!(p.delete, vec!["failed"]);
        assert_eq!(p.failed, 1);
        assert_eq!(p.create, 1);
    }

    #[test]
    fn terminating_pods_are_ignored() {
        let mut gone = pod("gone", Some("n1"), true, 0);
        gone.metadata.deletion_timestamp = Some(Time(t(90)));
        let p = plan(&[gone], 1, 30, t(100));
        assert_eq!(p.create, 1);
        assert!(p.delete.is_empty());
    }

    #[test]
    fn a_changed_spec_rolls_one_decoder_at_a_time() {
        let pods = vec![
            stale(pod("a", Some("n1"), true, 0)),
            stale(pod("b", Some("n2"), true, 10)),
            pod("c", Some("n3"), true, 20),
        ];
        let p = plan(&pods, 3, 30, t(100));
        assert_eq!((p.create, p.drain.clone()), (1, vec!["b".to_string()]));
        // While the successor is not ready, nothing else moves.
        let mut next = vec![
            pods[0].clone(),
            pods[2].clone(),
            pod("d", Some("n2"), false, 101),
        ];
        assert_eq!(plan(&next, 3, 30, t(102)), FleetPlan::default());
        next[2] = pod("d", Some("n2"), true, 101);
        assert_eq!(plan(&next, 3, 30, t(110)).drain, vec!["a"]);
    }

    #[test]
    fn scale_down_prefers_stale_decoders() {
        let pods = vec![
            pod("fresh", Some("n1"), true, 50),
            stale(pod("old", Some("n2"), true, 0)),
        ];
        assert_eq!(plan(&pods, 1, 30, t(100)).drain, vec!["old"]);
    }

    #[test]
    fn status_counts_ready_draining_and_nodes() {
        let pods = vec![
            pod("a", Some("n1"), true, 0),
            pod("b", Some("n1"), true, 0),
            pod("c", Some("n2"), false, 0),
            draining(pod("d", Some("n3"), true, 0), 0),
        ];
        let s = fleet_status(&pods, 3);
        assert_eq!((s.desired, s.ready, s.draining, s.nodes), (3, 2, 1, 1));
    }
}
