//! Per-pipeline retries after a failed reconcile: 5 s, doubling, at most 5 min; a success or a
//! spec change (a new generation) starts over. Before this every failure retried every 5 s,
//! and a pipeline that could never succeed (pods forbidden by a quota) wrote to the API server
//! 12 times a minute, forever.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::api::PipelineKey;

/// The wait after the first failure.
pub const FIRST_RETRY: Duration = Duration::from_secs(5);
/// The longest wait, however many failures came before.
pub const MAX_RETRY: Duration = Duration::from_secs(300);

/// The wait after `failures` consecutive failures (the first is 1).
pub fn retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_RETRY.saturating_mul(1 << doublings).min(MAX_RETRY)
}

#[derive(Debug, Clone, Copy)]
struct Failing {
    failures: u32,
    retry_at: Instant,
    generation: Option<i64>,
}

/// The failing pipelines and when each may be tried again.
#[derive(Debug, Default)]
pub struct RetryBackoff {
    failing: Mutex<HashMap<PipelineKey, Failing>>,
}

impl RetryBackoff {
    /// Records a failure and returns the wait before the next try.
    pub fn failed(&self, key: &PipelineKey, generation: Option<i64>, now: Instant) -> Duration {
        let mut failing = self.lock();
        let failures = match failing.get(key) {
            Some(f) if f.generation == generation => f.failures.saturating_add(1),
            _ => 1,
        };
        let delay = retry_delay(failures);
        failing.insert(
            key.clone(),
            Failing {
                failures,
                retry_at: now + delay,
                generation,
            },
        );
        delay
    }

    /// A success: the next failure waits [`FIRST_RETRY`] again.
    pub fn succeeded(&self, key: &PipelineKey) {
        self.lock().remove(key);
    }

    /// How long a failing pipeline must still wait; `None` when it may be reconciled now
    /// (not failing, its wait is over, or its spec changed since it failed). The controller
    /// also wakes a pipeline for changes of its children or its own status; without this
    /// those wake-ups would retry at once and undo the backoff.
    pub fn wait(
        &self,
        key: &PipelineKey,
        generation: Option<i64>,
        now: Instant,
    ) -> Option<Duration> {
        let failing = self.lock();
        let f = failing.get(key)?;
        (f.generation == generation && f.retry_at > now).then(|| f.retry_at - now)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PipelineKey, Failing>> {
        self.failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> PipelineKey {
        PipelineKey::new("ns", name)
    }

    #[test]
    fn delays_double_from_5s_to_a_5min_cap() {
        let secs: Vec<u64> = (1..=9).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY);
        assert_eq!(retry_delay(0), FIRST_RETRY);
    }

    #[test]
    fn backoff_is_per_pipeline_and_resets_on_success() {
        let backoff = RetryBackoff::default();
        let t0 = Instant::now();
        let a = key("a");
        let delays: Vec<u64> = (0..4)
            .map(|_| backoff.failed(&a, Some(1), t0).as_secs())
            .collect();
        assert_eq!(delays, [5, 10, 20, 40]);
        // Another pipeline starts at the first delay.
        assert_eq!(backoff.failed(&key("b"), Some(1), t0), FIRST_RETRY);
        backoff.succeeded(&a);
        assert_eq!(backoff.failed(&a, Some(1), t0), FIRST_RETRY);
    }

    #[test]
    fn a_failing_pipeline_waits_unless_its_spec_changed() {
        let backoff = RetryBackoff::default();
        let t0 = Instant::now();
        let a = key("a");
        assert_eq!(backoff.wait(&a, Some(1), t0), None, "never failed");
        backoff.failed(&a, Some(1), t0);
        backoff.failed(&a, Some(1), t0);
        let later = t0 + Duration::from_secs(4);
        assert_eq!(
            backoff.wait(&a, Some(1), later),
            Some(Duration::from_secs(6))
        );
        assert_eq!(
            backoff.wait(&a, Some(1), t0 + Duration::from_secs(10)),
            None
        );
        // A new generation is tried at once, and its failures count from one.
        assert_eq!(backoff.wait(&a, Some(2), later), None);
        assert_eq!(backoff.failed(&a, Some(2), later), FIRST_RETRY);
    }
}
