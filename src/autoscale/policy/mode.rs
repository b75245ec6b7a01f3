//! The decoder count the fleet runs in each mode, decided here only: `fixed` runs
//! autoscaling.replicas, `recommend` reports and keeps minReplicas, `auto` follows the
//! recommendation within minReplicas..=maxReplicas.

use crate::api::v1alpha1::{AutoscalingMode, DataPipelineSpec};

use super::{AutoscalingPolicy, ScaleDecision};

impl AutoscalingPolicy {
    /// The decoder count for the mode, given the autoscaler's recommendation (`None`: none
    /// yet, minReplicas).
    pub fn fleet_size(&self, recommended: Option<u32>) -> u32 {
        match self.mode {
            AutoscalingMode::Off => self.fixed_replicas.unwrap_or(self.min_replicas),
            AutoscalingMode::Recommend => self.min_replicas,
            AutoscalingMode::Auto => self.bound(recommended.unwrap_or(self.min_replicas)),
        }
    }
}

/// The decoder count a pipeline runs now, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecoderCount {
    pub replicas: u32,
    /// For `status.lastScale` when the count changes.
    pub reason: String,
}

/// The decoder count for `spec`'s mode. `decision`: the autoscaler's, when one was made now;
/// `in_effect`: with an autoscaler running, the count already in effect
/// (`status.decoders.desired`), which stands between decisions; `None` without an autoscaler.
pub fn decoder_count(
    spec: &DataPipelineSpec,
    decision: Option<&ScaleDecision>,
    in_effect: Option<u32>,
) -> DecoderCount {
    let policy = AutoscalingPolicy::from_spec(spec);
    let recommended = decision.map(|d| d.recommended).or(in_effect);
    DecoderCount {
        replicas: policy.fleet_size(recommended),
        reason: decision.map_or_else(|| undecided_reason(policy.mode), |d| d.reason.clone()),
    }
}

fn undecided_reason(mode: AutoscalingMode) -> String {
    match mode {
        AutoscalingMode::Off => "autoscaling.mode is fixed: autoscaling.replicas",
        AutoscalingMode::Recommend => "autoscaling.mode is recommend: decoders.minReplicas",
        AutoscalingMode::Auto => "no autoscaler signals yet: decoders.minReplicas",
    }
    .to_string()
}

/// The decision when autoscaling is off: the fixed count, nothing measured or moved.
pub(super) fn fixed(policy: &AutoscalingPolicy, mut d: ScaleDecision) -> ScaleDecision {
    let fixed = policy.fleet_size(None);
    d.recommended = fixed;
    d.replicas = fixed;
    d.local_decode_share = 0.0;
    d.reason = format!("autoscaling off: {fixed} decoders");
    d
}

/// Sets the fleet size for the mode. Recommend mode acts on nothing.
pub(super) fn finish(policy: &AutoscalingPolicy, mut d: ScaleDecision) -> ScaleDecision {
    d.recommended = policy.bound(d.recommended);
    d.replicas = policy.fleet_size(Some(d.recommended));
    if policy.mode == AutoscalingMode::Recommend {
        d.move_pods.clear();
        d.local_decode_share = 0.0;
        d.reason = format!("recommend only: {}", d.reason);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::super::testing::{Case, check, policy};
    use super::super::{ScaleHistory, decide};
    use super::*;

    #[test]
    fn the_mode_decides_what_the_fleet_runs() {
        check(vec![
            Case {
                name: "recommend mode: the fleet keeps minReplicas",
                policy: AutoscalingPolicy {
                    mode: AutoscalingMode::Recommend,
                    ..policy()
                },
                replicas: 2,
                starved: true,
                reason: "recommend only: data wait 30% > 5%",
                ..Case::default()
            },
            Case {
                name: "off: the fixed count",
                policy: AutoscalingPolicy {
                    mode: AutoscalingMode::Off,
                    fixed_replicas: Some(5),
                    ..policy()
                },
                replicas: 5,
                reason: "autoscaling off: 5 decoders",
                ..Case::default()
            },
        ]);
    }

    fn crop() -> DataPipelineSpec {
        let dp: crate::api::DataPipeline = serde_yaml::from_str(include_str!(
            "../../../tests/fixtures/datapipeline-crop.yaml"
        ))
        .expect("fixture");
        dp.spec
    }

    /// A decision that recommends `n` decoders, for `spec`.
    fn recommending(spec: &DataPipelineSpec, n: u32) -> ScaleDecision {
        let mut d = decide(
            &AutoscalingPolicy::from_spec(spec),
            &super::super::DecoderFleet::default(),
            None,
            &ScaleHistory::default(),
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        );
        d.recommended = n;
        d
    }

    #[test]
    fn desired_follows_the_mode() {
        let spec = crop();
        let replicas = |spec: &DataPipelineSpec, n: Option<u32>| {
            let d = n.map(|n| recommending(spec, n));
            decoder_count(spec, d.as_ref(), None).replicas
        };
        assert_eq!(replicas(&spec, None), 4);
        assert_eq!(replicas(&spec, Some(100)), 64);
        assert_eq!(replicas(&spec, Some(10)), 10);
        let mut spec = spec.clone();
        spec.autoscaling.mode = AutoscalingMode::Recommend;
        assert_eq!(replicas(&spec, Some(10)), 4);
        spec.autoscaling.mode = AutoscalingMode::Off;
        spec.autoscaling.replicas = Some(7);
        assert_eq!(replicas(&spec, Some(10)), 7);
    }

    #[test]
    fn between_decisions_the_count_in_effect_stands() {
        let spec = crop();
        let count = decoder_count(&spec, None, Some(10));
        assert_eq!(count.replicas, 10);
        assert_eq!(decoder_count(&spec, None, Some(100)).replicas, 64);
        assert_eq!(decoder_count(&spec, None, Some(0)).replicas, 4);
        // Without an autoscaler, minReplicas.
        assert_eq!(decoder_count(&spec, None, None).replicas, 4);
    }

    #[test]
    fn the_reason_is_the_decisions_or_the_modes() {
        let mut spec = crop();
        let undecided = |spec: &DataPipelineSpec| decoder_count(spec, None, None).reason;
        assert_eq!(
            undecided(&spec),
            "no autoscaler signals yet: decoders.minReplicas"
        );
        let d = recommending(&spec, 10);
        assert_eq!(decoder_count(&spec, Some(&d), None).reason, d.reason);
        spec.autoscaling.mode = AutoscalingMode::Recommend;
        assert_eq!(
            undecided(&spec),
            "autoscaling.mode is recommend: decoders.minReplicas"
        );
        let d = recommending(&spec, 10);
        assert!(
            decoder_count(&spec, Some(&d), None)
                .reason
                .starts_with("recommend only: ")
        );
        spec.autoscaling.mode = AutoscalingMode::Off;
        spec.autoscaling.replicas = Some(7);
        assert_eq!(
            undecided(&spec),
            "autoscaling.mode is fixed: autoscaling.replicas"
        );
        assert_eq!(decoder_count(&spec, None, Some(3)).replicas, 7);
    }
}
