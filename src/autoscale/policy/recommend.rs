//! The count the readings add up to, and why: the needed count, unless something says more
//! decoders cannot help (a saturated trainer NIC, S3 throttling) or are not wanted (no
//! starvation). The tolerance band and the windows come after (`windows.rs`).

use super::demand::{DecoderRate, Demand, Need};
use super::reason::{count, pct};
use super::s3::S3Throttle;
use super::{AutoscalingPolicy, DecoderFleet, ScaleDecision, Snapshot};

/// What one decision measured, for the recommendation.
pub(super) struct Reading {
    pub demand: Demand,
    pub rate: DecoderRate,
    pub need: Need,
    pub throttle: S3Throttle,
    /// The first trainer node whose own NIC starves it: more decoders cannot help.
    pub saturated: Option<String>,
}

/// The raw recommendation from `current`; sets `d.reason`.
pub(super) fn recommend(
    d: &mut ScaleDecision,
    snap: &Snapshot<'_>,
    current: u32,
    r: &Reading,
) -> u32 {
    let policy = snap.policy;
    let (wait, target) = (pct(r.demand.wait), pct(policy.target_data_wait));
    let wait_text = if r.demand.starved {
        format!("data wait {wait} > {target}")
    } else {
        format!("data wait {wait} ≤ {target}")
    };
    let (raw, reason) = match &r.saturated {
        Some(node) => (
            current,
            format!(
                "{wait_text}; trainer node {node} NIC above {}: more decoders cannot help; local decode {}",
                pct(policy.max_nic_utilization),
                pct(d.local_decode_share)
            ),
        ),
        None => by_need(policy, snap.fleet, current, r, &wait_text),
    };
    d.reason = reason;
    raw
}

/// The recommendation when the trainer nodes' NICs are not the limit.
fn by_need(
    policy: &AutoscalingPolicy,
    fleet: &DecoderFleet,
    current: u32,
    r: &Reading,
    wait_text: &str,
) -> (u32, String) {
    let (starved, throttled) = (r.demand.starved, r.throttle.held);
    let need_text = |n: u32, rate: f64| {
        format!(
            "need {}/s at {}/s per decoder → {n}",
            count(r.need.samples_per_second),
            count(rate)
        )
    };
    match (r.need.decoders, r.rate.per_decoder) {
        // Trainers starved with no decoder at all: nothing was delivered, so nothing
        // measures the demand; start one step up.
        _ if current == 0 && starved && !throttled => {
            let n = policy.max_scale_up_step.max(1);
            (n, format!("{wait_text} with no decoders → {n}"))
        }
        (Some(n), Some(rate)) if n > current && throttled => (
            current,
            format!(
                "{wait_text} but {} ({})",
                r.throttle.text(policy),
                need_text(n, rate)
            ),
        ),
        (Some(n), Some(rate)) if r.demand.following => (
            n,
            format!(
                "trainers {} → {}: {}",
                r.demand.trainers_before,
                fleet.trainers,
                need_text(n, rate)
            ),
        ),
        (Some(n), Some(rate)) if n > current && !starved => (
            current,
            format!("{wait_text}: keeping {current} ({})", need_text(n, rate)),
        ),
        (Some(n), Some(rate)) if n < current && starved => (
            current,
            format!(
                "{wait_text} but decoders only {} busy: the decoder count is not the bottleneck ({})",
                pct(r.rate.busy_share.unwrap_or(0.0)),
                need_text(n, rate)
            ),
        ),
        (Some(n), Some(rate)) => (n, format!("{wait_text}: {}", need_text(n, rate))),
        _ if starved && !throttled => {
            let n = current.saturating_add(policy.max_scale_up_step.max(1));
            (
                n,
                format!("{wait_text}: no per-decoder rate measured yet → {n}"),
            )
        }
        _ if starved => (
            current,
            format!("{wait_text} but {}", r.throttle.text(policy)),
        ),
        _ => (
            current,
            format!("{wait_text}: no per-decoder rate measured yet: keeping {current}"),
        ),
    }
}
