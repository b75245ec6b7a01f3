//! What keeps the fleet from flapping: a tolerance band around the current count,
//! stabilization windows (like the HPA's), step limits, and minReplicas..=maxReplicas.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::reason::pct;
use super::{AutoscalingPolicy, ScaleDecision, Snapshot, mode};

/// Tolerance band: small relative changes are noise. Bounds always win over the band, and a
/// followed trainer change is no noise.
pub(super) fn tolerate(
    d: &mut ScaleDecision,
    policy: &AutoscalingPolicy,
    current: u32,
    raw: u32,
    following: bool,
) -> u32 {
    let in_bounds = policy.replica_range().contains(&current);
    let noise =
        (f64::from(raw) - f64::from(current)).abs() <= policy.tolerance * f64::from(current);
    if in_bounds && !following && raw != current && noise {
        d.reason.push_str(&format!(
            "; within the {} band of {current}: no change",
            pct(policy.tolerance)
        ));
        current
    } else {
        raw
    }
}

/// Applies the stabilization windows, step limits and bounds to the raw recommendation, then
/// the mode. `skip_down_window`: the drop follows trainers that left, not a measurement that
/// may be noise.
pub(super) fn stabilize(
    snap: &Snapshot<'_>,
    mut d: ScaleDecision,
    current: u32,
    raw: u32,
    skip_down_window: bool,
) -> ScaleDecision {
    let policy = snap.policy;
    let within = |window: Duration| recommendations_within(snap, window, current);
    let mut to = raw;
    if raw < current && !skip_down_window {
        // Like the HPA: the highest recommendation of the window, so one low reading never
        // removes decoders.
        let held = within(policy.scale_down_stabilization)
            .fold(raw, u32::max)
            .min(current);
        if held > raw {
            d.reason.push_str(&format!(
                "; scale-down window {}s holds {held}",
                policy.scale_down_stabilization.as_secs()
            ));
        }
        to = held;
    } else if raw > current && !policy.scale_up_stabilization.is_zero() {
        let held = within(policy.scale_up_stabilization)
            .fold(raw, u32::min)
            .max(current);
        if held < raw {
            d.reason.push_str(&format!(
                "; scale-up window {}s holds {held}",
                policy.scale_up_stabilization.as_secs()
            ));
        }
        to = held;
    }
    d.recommended = step_and_bound(policy, &mut d.reason, current, to);
    mode::finish(policy, d)
}

/// The window's recommendations. Until the history spans the whole window (a fresh start,
/// an outage) the current size counts as one of them, so nothing moves on a short look.
fn recommendations_within<'a>(
    snap: &Snapshot<'a>,
    window: Duration,
    current: u32,
) -> impl Iterator<Item = u32> + 'a {
    let (history, now) = (snap.history, snap.now);
    let secs = window.as_secs_f64();
    let covered = history
        .recommendations
        .front()
        .is_some_and(|(t, _)| elapsed(*t, now) >= secs);
    history
        .recommendations
        .iter()
        .filter(move |(t, _)| elapsed(*t, now) < secs)
        .map(|(_, r)| *r)
        .chain((!covered && secs > 0.0).then_some(current))
}

/// At most a step up or down from `current`, then within minReplicas..=maxReplicas; each
/// limit that bites is said in `reason`.
fn step_and_bound(policy: &AutoscalingPolicy, reason: &mut String, current: u32, to: u32) -> u32 {
    let up = current.saturating_add(policy.max_scale_up_step.max(1));
    let down = current.saturating_sub(policy.max_scale_down_step.max(1));
    let stepped = to.clamp(down, up);
    if stepped != to {
        reason.push_str(&format!("; step limit → {stepped}"));
    }
    let bounded = policy.bound(stepped);
    if bounded != stepped {
        let which = if bounded == policy.min_replicas {
            "minReplicas"
        } else {
            "maxReplicas"
        };
        reason.push_str(&format!("; {which} {bounded}"));
    }
    bounded
}

/// How long after a change the window holds only samples from after it: rate() lags by up
/// to a window, and scrapes and evaluation add up to about another.
pub(super) fn settle_seconds(policy: &AutoscalingPolicy) -> f64 {
    2.0 * policy.window.as_secs_f64()
}

pub(super) fn elapsed(since: Timestamp, now: Timestamp) -> f64 {
    now.duration_since(since).as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::super::AutoscalingPolicy;
    use super::super::testing::*;

    #[test]
    fn the_windows_hold_a_drop() {
        let over = || signals(20, 0.238, 0.01);
        check(vec![
            Case {
                name: "over-provisioned, first look: the scale-down window holds",
                signals: Some(over()),
                fleet: fleet(20, 8),
                replicas: 20,
                reason: "scale-down window 300s holds 20",
                ..Case::default()
            },
            Case {
                name: "over-provisioned for a whole window: down by the step limit",
                signals: Some(over()),
                fleet: fleet(20, 8),
                history: settled(&policy(), &fleet(20, 8), &over()),
                replicas: 12,
                reason: "need 1,010/s at 210/s per decoder → 6; step limit → 12",
                ..Case::default()
            },
        ]);
    }

    #[test]
    fn noise_inside_the_band_changes_nothing() {
        let mut noisy_high = signals(10, 0.85, 0.06);
        noisy_high.consumption_per_second = Some(1785.0);
        let noisy_low = signals(10, 0.7, 0.01);
        check(vec![
            Case {
                name: "noise above the target inside the band: no change",
                signals: Some(noisy_high),
                fleet: fleet(10, 8),
                replicas: 10,
                starved: true,
                reason: "within the 10% band of 10",
                ..Case::default()
            },
            Case {
                name: "noise below the target inside the band: no change",
                history: settled(&policy(), &fleet(10, 8), &noisy_low),
                signals: Some(noisy_low),
                fleet: fleet(10, 8),
                replicas: 10,
                reason: "within the 10% band of 10",
                ..Case::default()
            },
        ]);
    }

    #[test]
    fn bounds_win() {
        check(vec![Case {
            name: "demand beyond maxReplicas",
            policy: AutoscalingPolicy {
                max_replicas: 12,
                ..policy()
            },
            replicas: 12,
            starved: true,
            reason: "→ 14; maxReplicas 12",
            ..Case::default()
        }]);
    }
}
