//! Checks the API server cannot make (its CEL rules cover the rest). Pure.

use crate::api::DataPipelineSpec;
use crate::build::BuildDefaults;

/// Problems that keep the pipeline from running as written; empty when it can.
pub fn validate(spec: &DataPipelineSpec, defaults: &BuildDefaults) -> Vec<String> {
    let mut problems = Vec::new();
    let image = spec
        .decoders
        .image
        .as_deref()
        .unwrap_or(&defaults.loader_image);
    if image.trim().is_empty() {
        problems
            .push("decoders.image is empty and the operator has no default loader image".into());
    } else if let Some(refused) = defaults.image_refusal(spec) {
        // Admission refuses it too; this catches pipelines admitted before the policy changed.
        problems.push(refused);
    }
    // Rules the API server also enforces, kept here for servers that skip CEL (or objects
    // written before a rule existed).
    if spec.decoders.min_replicas > spec.decoders.max_replicas {
        problems.push("decoders.minReplicas must not exceed decoders.maxReplicas".into());
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DataPipelineSpec {
        let dp: crate::api::DataPipeline =
            serde_yaml::from_str(include_str!("../../tests/fixtures/datapipeline-crop.yaml"))
                .expect("fixture");
        dp.spec
    }

    #[test]
    fn a_valid_spec_has_no_problems() {
        assert!(validate(&spec(), &BuildDefaults::default()).is_empty());
    }

    #[test]
    fn reports_what_the_api_server_may_not_have_checked() {
        let mut s = spec();
        s.decoders.min_replicas = 99;
        s.decoders.image = Some(" ".into());
        let problems = validate(&s, &BuildDefaults::default());
        assert_eq!(problems.len(), 2, "{problems:?}");
    }

    #[test]
    fn an_image_the_installation_does_not_allow_is_a_problem() {
        let mut s = spec();
        s.decoders.image = Some("attacker.example/miner:1".into());
        let problems = validate(&s, &BuildDefaults::default());
        assert_eq!(
            problems,
            [
                "decoders.image: attacker.example/miner:1 is not an image this installation allows (the chart's decoders.allowedImages)"
            ]
        );
        let allowing = BuildDefaults {
            allowed_images: vec!["attacker.example/*".into()],
            ..BuildDefaults::default()
        };
        assert!(validate(&s, &allowing).is_empty());
    }
}
