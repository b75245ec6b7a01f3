//! The one retry policy of the loader: exponential backoff (full jitter where many callers
//! retry at once), a bound on attempts, and the driver every retry loop runs through (S3's
//! GET, LIST and PUT; the sidecar's re-sends of a decode request use its delays).

use std::future::Future;
use std::time::Duration;

/// Attempt n (1-based, after n failures) waits up to min(cap, base·2ⁿ): uniformly below it
/// with `jitter`, exactly it without.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; `u32::MAX` for no bound.
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
    /// Full jitter: many clients backing off from one throttled store spread out instead of
    /// coming back together.
    pub jitter: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            base: Duration::from_millis(25),
            cap: Duration::from_secs(5),
            jitter: true,
        }
    }
}

/// How one attempt ended.
#[derive(Debug)]
pub enum Outcome<T, E> {
    Done(T),
    /// Transient: try again after the backoff, while attempts are left.
    Retry(E),
    /// Final: no further attempt.
    Final(E),
}

/// Why the driver stopped without a result: the last attempt's error and how many attempts
/// were made; `exhausted` when it was a transient error that ran out of attempts.
#[derive(Debug)]
pub struct GaveUp<E> {
    pub error: E,
    pub attempts: u32,
    pub exhausted: bool,
}

impl RetryPolicy {
    /// Doubling pauses without jitter and without a bound on attempts.
    pub const fn doubling(base: Duration, cap: Duration) -> Self {
        Self {
            max_attempts: u32::MAX,
            base,
            cap,
            jitter: false,
        }
    }

    /// The pause after `attempt` failures.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.cap);
        if self.jitter {
            ceiling.mul_f64(fastrand::f64())
        } else {
            ceiling
        }
    }

    /// Runs `attempt(n)` (n = 0, 1, ...) until it is done or final, or `max_attempts` ran;
    /// `on_retry` sees each transient error just before the backoff it causes.
    pub async fn run<T, E, F, Fut>(
        &self,
        mut attempt: F,
        mut on_retry: impl FnMut(&E),
    ) -> Result<T, GaveUp<E>>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Outcome<T, E>>,
    {
        let mut made = 0u32;
        loop {
            let outcome = attempt(made).await;
            made += 1;
            let error = match outcome {
                Outcome::Done(value) => return Ok(value),
                Outcome::Final(error) => {
                    return Err(GaveUp {
                        error,
                        attempts: made,
                        exhausted: false,
                    });
                }
                Outcome::Retry(error) => error,
            };
            if made >= self.max_attempts {
                return Err(GaveUp {
                    error,
                    attempts: made,
                    exhausted: true,
                });
            }
            on_retry(&error);
            tokio::time::sleep(self.backoff(made)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_and_jitter_stays_below_it() {
        let doubling = RetryPolicy::doubling(Duration::from_millis(5), Duration::from_millis(80));
        let pauses: Vec<u64> = (1..=6)
            .map(|n| doubling.backoff(n).as_millis() as u64)
            .collect();
        assert_eq!(pauses, [10, 20, 40, 80, 80, 80]);
        let jittered = RetryPolicy::default();
        for n in 0..30 {
            assert!(jittered.backoff(n) <= jittered.cap);
        }
    }

    #[tokio::test]
    async fn the_driver_stops_at_done_final_or_the_attempt_bound() {
        let policy = RetryPolicy {
            max_attempts: 3,
            base: Duration::ZERO,
            cap: Duration::ZERO,
            jitter: true,
        };
        let mut retries = 0;
        let done = policy
            .run(
                |n| async move {
                    if n < 2 {
                        Outcome::Retry(n)
                    } else {
                        Outcome::Done(n)
                    }
                },
                |_| retries += 1,
            )
            .await;
        assert_eq!(done.ok(), Some(2));
        assert_eq!(retries, 2, "a retry before each backoff");

        let exhausted = policy
            .run(|n| async move { Outcome::<(), _>::Retry(n) }, |_| {})
            .await
            .err()
            .map(|g| (g.error, g.attempts, g.exhausted));
        assert_eq!(exhausted, Some((2, 3, true)));

        let final_ = policy
            .run(|n| async move { Outcome::<(), _>::Final(n) }, |_| {})
            .await
            .err()
            .map(|g| (g.error, g.attempts, g.exhausted));
        assert_eq!(final_, Some((0, 1, false)));
    }
}
