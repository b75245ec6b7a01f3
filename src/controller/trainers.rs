//! The pipeline's trainer pods, as status reports them. Pure.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::api::v1alpha1::TrainerStatus;
use crate::api::{ANNOTATION_INJECTED, ANNOTATION_WORLD_SIZE};
use crate::build::sidecar::{RANK_SOURCES, SIDECAR_NAME};

fn is_live(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && !matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed" | "Succeeded")
        )
}

pub(super) fn is_injected(pod: &Pod) -> bool {
    pod.annotations().contains_key(ANNOTATION_INJECTED)
        || pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.name == SIDECAR_NAME))
}

/// Counts trainers; the world size is the largest one a pod declares, else the pod count, so an
/// elastic job that adds or removes ranks is reflected without touching the decoders.
pub fn trainer_status(trainers: &[Pod]) -> TrainerStatus {
    let live: Vec<&Pod> = trainers.iter().filter(|p| is_live(p)).collect();
    let pods = i32::try_from(live.len()).unwrap_or(i32::MAX);
    let injected =
        i32::try_from(live.iter().filter(|p| is_injected(p)).count()).unwrap_or(i32::MAX);
    let declared = live
        .iter()
        .filter_map(|p| {
            p.annotations()
                .get(ANNOTATION_WORLD_SIZE)
                .or_else(|| p.labels().get(ANNOTATION_WORLD_SIZE))
                .and_then(|v| v.parse::<i32>().ok())
        })
        .max();
    let mut ranks: Vec<i32> = live.iter().filter_map(|p| rank(p)).collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks.truncate(MAX_RANKS);
    TrainerStatus {
        pods,
        injected,
        world_size: declared.unwrap_or(pods),
        ranks,
    }
}

/// Ranks listed in status at most (the CRD's bound).
const MAX_RANKS: usize = 4096;

/// A trainer pod's rank: a literal `RANK` in a container, else the annotations the sidecar
/// reads it from.
fn rank(pod: &Pod) -> Option<i32> {
    let literal = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.env.iter().flatten())
        .find(|e| e.name == "RANK")
        .and_then(|e| e.value.as_deref()?.parse().ok());
    literal.or_else(|| {
        RANK_SOURCES
            .iter()
            .find_map(|k| pod.annotations().get(*k)?.parse().ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn pod(world: Option<&str>, injected: bool) -> Pod {
        let mut p = Pod::default();
        if let Some(w) = world {
            p.metadata.annotations = Some(BTreeMap::from([(
                ANNOTATION_WORLD_SIZE.to_string(),
                w.to_string(),
            )]));
        }
        if injected {
            p.annotations_mut()
                .insert(ANNOTATION_INJECTED.to_string(), "true".into());
        }
        p
    }

    #[test]
    fn lists_the_ranks_seen() {
        let mut a = pod(None, true);
        a.annotations_mut()
            .insert(crate::api::ANNOTATION_RANK.into(), "1".into());
        let mut b = pod(None, true);
        b.annotations_mut().insert(
            "batch.kubernetes.io/job-completion-index".into(),
            "0".into(),
        );
        let mut c = pod(None, true);
        c.annotations_mut()
            .insert(crate::api::ANNOTATION_RANK.into(), "1".into());
        assert_eq!(trainer_status(&[a, b, c]).ranks, vec![0, 1]);
    }

    #[test]
    fn counts_pods_injection_and_world_size() {
        let s = trainer_status(&[pod(None, true), pod(None, false)]);
        assert_eq!((s.pods, s.injected, s.world_size), (2, 1, 2));
        let s = trainer_status(&[pod(Some("16"), true), pod(Some("16"), true)]);
        assert_eq!(s.world_size, 16);
        assert_eq!(trainer_status(&[]).pods, 0);
    }
}
