//! A reconcile reads decoder pods from the controller's watch cache, which can lag behind the
//! reconcile's own writes: a pod just created may not be there yet, a pod just drained may still
//! show undrained. Read as is, the next reconcile would create or drain again. Like the
//! controller-manager's ReplicaSet expectations, each pipeline's last pod writes are laid over
//! the cache until the cache has caught up with them (or they are too old to matter).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::api::PipelineKey;

/// After this long a write the cache never showed is dropped: the pod went away in between
/// (its creation and deletion both fell in a watch gap), and the cache is right.
const EXPECTATION_TTL: Duration = Duration::from_secs(60);

/// One pod write the cache may not show yet.
#[derive(Clone, Debug)]
enum Expected {
    /// Created or patched: the server's reply, with its resourceVersion.
    Written(Box<Pod>),
    /// Deleted: the pod counts as gone whatever the cache still says.
    Deleted,
}

#[derive(Debug)]
struct Pending {
    pods: HashMap<String, Expected>,
    since: Instant,
}

/// Pod writes per pipeline (namespace, name) that the cache has not shown yet.
#[derive(Debug, Default)]
pub struct PodExpectations {
    pending: Mutex<HashMap<PipelineKey, Pending>>,
}

impl PodExpectations {
    /// Remembers one reconcile's pod writes: the replies to creates and drains, the names deleted.
    pub fn record(&self, pipeline: PipelineKey, written: Vec<Pod>, deleted: Vec<String>) {
        if written.is_empty() && deleted.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut pending = self.lock();
        let entry = pending.entry(pipeline).or_insert_with(|| Pending {
            pods: HashMap::new(),
            since: now,
        });
        entry.since = now;
        for pod in written {
            entry
                .pods
                .insert(pod.name_any(), Expected::Written(Box::new(pod)));
        }
        for name in deleted {
            entry.pods.insert(name, Expected::Deleted);
        }
    }

    /// The cached pods of `pipeline` with its writes the cache has not caught up with laid over;
    /// writes the cache now shows are forgotten.
    pub fn overlay(&self, pipeline: &PipelineKey, cached: Vec<Pod>) -> Vec<Pod> {
        let mut pending = self.lock();
        let Some(entry) = pending.get_mut(pipeline) else {
            return cached;
        };
        if entry.since.elapsed() > EXPECTATION_TTL {
            pending.remove(pipeline);
            return cached;
        }
        let mut pods: HashMap<String, Pod> =
            cached.into_iter().map(|p| (p.name_any(), p)).collect();
        // A write the cache now shows is forgotten; one it does not stands in for the cache.
        entry.pods.retain(|name, expected| match expected {
            Expected::Written(reply) => {
                if pods.get(name).is_some_and(|seen| at_least(seen, reply)) {
                    return false;
                }
                pods.insert(name.clone(), (**reply).clone());
                true
            }
            Expected::Deleted => {
                let gone = pods
                    .get(name)
                    .is_none_or(|seen| seen.metadata.deletion_timestamp.is_some());
                if !gone {
                    pods.remove(name);
                }
                !gone
            }
        });
        if entry.pods.is_empty() {
            pending.remove(pipeline);
        }
        let mut pods: Vec<Pod> = pods.into_values().collect();
        pods.sort_by_key(ResourceExt::name_any);
        pods
    }

    /// Forgets everything: a new term of leadership starts from a fresh cache.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PipelineKey, Pending>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether the cached copy is the reply's version or a later one. etcd's resourceVersions are
/// increasing integers (comparable since Kubernetes 1.35); anything else compares for equality.
fn at_least(cached: &Pod, reply: &Pod) -> bool {
    let (seen, wrote) = (
        cached.resource_version().unwrap_or_default(),
        reply.resource_version().unwrap_or_default(),
    );
    match (seen.parse::<u64>(), wrote.parse::<u64>()) {
        (Ok(seen), Ok(wrote)) => seen >= wrote,
        _ => seen == wrote,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pod(name: &str, rv: u64) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.resource_version = Some(rv.to_string());
        p
    }

    fn key() -> PipelineKey {
        PipelineKey::new("ns", "dp")
    }

    fn names_and_versions(pods: &[Pod]) -> Vec<(String, String)> {
        pods.iter()
            .map(|p| (p.name_any(), p.resource_version().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn a_created_pod_counts_before_the_cache_shows_it() {
        let e = PodExpectations::default();
        e.record(key(), vec![pod("b", 10)], vec![]);
        let seen = e.overlay(&key(), vec![pod("a", 5)]);
        assert_eq!(
            names_and_versions(&seen),
            [("a".into(), "5".into()), ("b".into(), "10".into())]
        );
        // Once the cache has it, the cache's copy stands and the write is forgotten.
        let seen = e.overlay(&key(), vec![pod("a", 5), pod("b", 12)]);
        assert_eq!(names_and_versions(&seen)[1], ("b".into(), "12".into()));
        assert!(e.lock().is_empty());
    }

    #[test]
    fn a_drained_pod_is_not_read_back_undrained_from_a_stale_cache() {
        let e = PodExpectations::default();
        let mut drained = pod("a", 20);
        drained
            .labels_mut()
            .insert("draining".into(), "true".into());
        e.record(key(), vec![drained], vec![]);
        let seen = e.overlay(&key(), vec![pod("a", 19)]);
        assert_eq!(
            seen[0].labels().get("draining").map(String::as_str),
            Some("true")
        );
    }

    #[test]
    fn a_deleted_pod_is_gone_even_while_the_cache_still_lists_it() {
        let e = PodExpectations::default();
        e.record(key(), vec![], vec!["a".into()]);
        assert!(e.overlay(&key(), vec![pod("a", 3)]).is_empty());
        let mut terminating = pod("a", 4);
        terminating.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        assert_eq!(e.overlay(&key(), vec![terminating]).len(), 1);
        assert!(
            e.lock().is_empty(),
            "a terminating pod in the cache is the deletion seen"
        );
    }

    #[test]
    fn other_pipelines_are_untouched() {
        let e = PodExpectations::default();
        e.record(key(), vec![pod("b", 10)], vec![]);
        let other = PipelineKey::new("ns", "other");
        assert_eq!(e.overlay(&other, vec![pod("x", 1)]).len(), 1);
    }

    #[test]
    fn old_writes_the_cache_never_showed_are_dropped() {
        let e = PodExpectations::default();
        e.record(key(), vec![pod("b", 10)], vec![]);
        e.lock().get_mut(&key()).expect("recorded").since =
            Instant::now() - EXPECTATION_TTL - Duration::from_secs(1);
        assert!(e.overlay(&key(), vec![]).is_empty());
    }
}
