//! S3 throttling: while S3 answers SlowDown, more decoders would only be throttled harder,
//! so the fleet does not grow.

use super::reason::pct;
use super::{AutoscalingPolicy, Signals};

/// How hard S3 throttles the decoders.
pub(super) struct S3Throttle {
    /// Share (0..=1) of requests throttled; `None` without the series or any request.
    pub share: Option<f64>,
    /// Above the limit: the fleet is held.
    pub held: bool,
}

pub(super) fn throttle(policy: &AutoscalingPolicy, s: &Signals) -> S3Throttle {
    let share = match (s.s3_throttles_per_second, s.s3_requests_per_second) {
        (Some(t), Some(r)) if r > 0.0 => Some(t / r),
        _ => None,
    };
    S3Throttle {
        share,
        held: share.is_some_and(|t| t > policy.max_s3_throttle_share),
    }
}

impl S3Throttle {
    /// Why the fleet does not grow, in numbers.
    pub fn text(&self, policy: &AutoscalingPolicy) -> String {
        format!(
            "S3 throttles {} of requests > {}: not scaling up",
            pct(self.share.unwrap_or(0.0)),
            pct(policy.max_s3_throttle_share),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;

    #[test]
    fn throttling_holds_the_fleet() {
        let mut throttled = signals(8, 1.0, 0.3);
        throttled.s3_throttles_per_second = Some(50.0);
        let mut quiet_throttled = quiet();
        quiet_throttled.s3_throttles_per_second = Some(50.0);
        check(vec![
            Case {
                name: "S3 throttling: no scale-up",
                signals: Some(throttled),
                replicas: 8,
                starved: true,
                s3_throttled: true,
                reason: "S3 throttles 5% of requests > 1%: not scaling up",
                ..Case::default()
            },
            Case {
                name: "more trainers while S3 throttles: no scale-up",
                signals: Some(quiet_throttled),
                fleet: fleet(8, 16),
                history: after_quiet(-30),
                replicas: 8,
                s3_throttled: true,
                reason: "S3 throttles 5% of requests > 1%: not scaling up",
                ..Case::default()
            },
        ]);
    }
}
