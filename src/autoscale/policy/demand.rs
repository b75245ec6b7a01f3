//! How many decoders the trainers need, in one step: the rate they would consume if never
//! starved ÷ the rate one decoder delivers × headroom.

use super::windows::{elapsed, settle_seconds};
use super::{AutoscalingPolicy, ScaleDecision, Snapshot};

/// Trainers waiting this long are treated as waiting this long: beyond it the measured rate
/// says little about what they would consume (and 1 − wait would divide by ~0).
const MAX_USABLE_WAIT: f64 = 0.95;
/// Below this much busy time in the whole fleet (in decoder-seconds per second) the per-decoder
/// rate is noise; the last good measurement stands.
const MIN_BUSY_FOR_RATE: f64 = 0.1;

/// What the trainers ask for.
pub(super) struct Demand {
    /// Share (0..=1) of wall time the trainers waited for data.
    pub wait: f64,
    /// Samples per second the sidecars handed to the trainers.
    pub consumption: f64,
    /// Samples per second the trainers would consume if never starved.
    pub samples_per_second: f64,
    /// The trainers wait more than the target.
    pub starved: bool,
    /// The trainer count changed within the settle time: demand follows the per-trainer demand.
    pub following: bool,
    /// The trainer count before the change being followed; the count now otherwise.
    pub trainers_before: u32,
}

/// The trainers' demand; `None` without the sidecars' data-wait and delivery series.
pub(super) fn demand(d: &mut ScaleDecision, snap: &Snapshot<'_>) -> Option<Demand> {
    let (policy, fleet, s) = (snap.policy, snap.fleet, snap.signals);
    let (Some(wait), Some(consumption)) = (s.data_wait_share, s.consumption_per_second) else {
        return None;
    };
    let usable_wait = wait.clamp(0.0, MAX_USABLE_WAIT);
    let measured = consumption / (1.0 - usable_wait);
    let starved = wait > policy.target_data_wait;
    d.conditions.starved = starved;

    let following = follows_trainer_change(d, snap);
    let trainers_before = d.learned.trainer_change.map_or(fleet.trainers, |(_, b)| b);
    let samples_per_second = match snap.history.per_trainer_demand {
        Some(per) if following => per * f64::from(fleet.trainers),
        _ => measured,
    };
    if !following {
        let reporting = s.trainers_reporting.unwrap_or(fleet.trainers).max(1);
        d.learned.per_trainer_demand = Some(measured / f64::from(reporting));
        d.learned.trainer_change = None;
    }
    Some(Demand {
        wait,
        consumption,
        samples_per_second,
        starved,
        following,
        trainers_before,
    })
}

/// Elastic training: a new trainer count changes demand before any starvation shows; follow
/// it from the per-trainer demand until the window holds only the new count.
fn follows_trainer_change(d: &mut ScaleDecision, snap: &Snapshot<'_>) -> bool {
    let (history, now) = (snap.history, snap.now);
    if let Some(before) = history.trainers.filter(|t| *t != snap.fleet.trainers) {
        // A second change while following keeps the count from before the first.
        let from = history.trainer_change.map_or(before, |(_, b)| b);
        d.learned.trainer_change = Some((now, from));
    }
    history.per_trainer_demand.is_some()
        && d.learned
            .trainer_change
            .is_some_and(|(t, _)| elapsed(t, now) < settle_seconds(snap.policy))
}

/// What one decoder delivers.
pub(super) struct DecoderRate {
    /// Samples per second of one fully busy decoder, capped by what its NIC carries.
    pub per_decoder: Option<f64>,
    /// The decoders' mean busy share (0..=1).
    pub busy_share: Option<f64>,
}

/// The per-decoder rate: the fleet's samples over its busy time, or the last good one, capped
/// by the NIC.
pub(super) fn decoder_rate(d: &mut ScaleDecision, snap: &Snapshot<'_>) -> DecoderRate {
    let s = snap.signals;
    let (sum_rate, sum_busy) = s.decoders.values().fold((0.0, 0.0), |(r, b), x| {
        (r + x.samples_per_second, b + x.busy_share)
    });
    if sum_busy >= MIN_BUSY_FOR_RATE && sum_rate > 0.0 {
        d.learned.decoder_rate = Some(sum_rate / sum_busy);
    }
    let busy_share = (!s.decoders.is_empty()).then(|| sum_busy / s.decoders.len() as f64);
    d.observed.decoder_busy_percent = busy_share.map(|b| b * 100.0);
    // A decoder behind a full NIC delivers what the NIC carries, not what its cores could:
    // with decoders spread one per node, that is the node's link at the limit.
    // Decoders that wait on their NIC are too idle to measure their own rate: the cap is it.
    let per_decoder = match (d.learned.decoder_rate, snap.nic_rate_cap()) {
        (Some(r), Some(cap)) => Some(r.min(cap)),
        (None, cap) => cap,
        (r, None) => r,
    };
    d.observed.decoder_samples_per_second = per_decoder;
    DecoderRate {
        per_decoder,
        busy_share,
    }
}

/// What the decoders must deliver, and how many it takes.
pub(super) struct Need {
    /// Samples per second the decoders serve: what the sidecars do not decode themselves.
    pub samples_per_second: f64,
    /// Decoders for that rate with headroom; `None` while no per-decoder rate is known.
    pub decoders: Option<u32>,
}

/// The decoder count the demand needs in one step; sets `d.needed`. Comes after the
/// local-decode share: decoders serve only what the sidecars do not decode themselves.
pub(super) fn need(
    d: &mut ScaleDecision,
    policy: &AutoscalingPolicy,
    demand: &Demand,
    rate: &DecoderRate,
) -> Need {
    let samples_per_second = demand.samples_per_second * (1.0 - d.local_decode_share);
    let decoders = rate
        .per_decoder
        .map(|r| ceil_count(samples_per_second * policy.headroom / r));
    d.needed = decoders;
    Need {
        samples_per_second,
        decoders,
    }
}

fn ceil_count(x: f64) -> u32 {
    if x.is_finite() && x > 0.0 {
        x.ceil().min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{AutoscalingPolicy, DecoderFleet, Signals};
    use std::collections::BTreeMap;

    #[test]
    fn demand_in_one_step() {
        let mut with_gpu = signals(8, 1.0, 0.3);
        with_gpu.gpu_utilization_percent = Some(38.0);
        check(vec![
            Case {
                name: "starvation: one step to the needed count",
                replicas: 14,
                starved: true,
                reason: "data wait 30% > 5%: need 2,400/s at 210/s per decoder → 14",
                ..Case::default()
            },
            Case {
                name: "starvation with the GPU metric present decides the same",
                signals: Some(with_gpu),
                replicas: 14,
                starved: true,
                reason: "need 2,400/s at 210/s per decoder → 14",
                ..Case::default()
            },
            Case {
                name: "starved with no decoders: one step up",
                policy: AutoscalingPolicy {
                    min_replicas: 0,
                    ..policy()
                },
                fleet: fleet(0, 8),
                signals: Some(Signals {
                    data_wait_share: Some(1.0),
                    consumption_per_second: Some(0.0),
                    ..Signals::default()
                }),
                history: after_quiet(-600),
                replicas: 8,
                starved: true,
                reason: "data wait 100% > 5% with no decoders → 8",
                ..Case::default()
            },
        ]);
    }

    #[test]
    fn demand_follows_the_trainer_count() {
        check(vec![
            Case {
                name: "trainers 8 → 16: follow demand before any starvation",
                signals: Some(quiet()),
                fleet: fleet(8, 16),
                history: after_quiet(-30),
                replicas: 11,
                reason: "trainers 8 → 16: need 1,867/s at 210/s per decoder → 11",
                ..Case::default()
            },
            Case {
                name: "trainers 16 → 8: follow without the scale-down window",
                signals: Some(signals(16, 0.55, 0.01)),
                fleet: DecoderFleet {
                    trainers: 4,
                    trainer_nodes: BTreeMap::from([(GPU_NODE.to_string(), 4)]),
                    ..fleet(16, 16)
                },
                history: after_quiet(-30),
                replicas: 8,
                reason: "trainers 8 → 4: need 467/s at 210/s per decoder → 3; step limit → 8",
                ..Case::default()
            },
        ]);
    }
}
