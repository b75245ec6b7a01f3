//! `crds/` and the chart's copy are generated from the Rust types; this fails on drift and, with
//! `UPDATE_CRDS=1`, rewrites both.

const FILE: &str = "datapipelines.stoker.dev.yaml";

#[test]
fn crds_match_the_rust_types() {
    let root = stoker_testenv::manifest_dir();
    let want = stoker_operator::api::crd_yaml().expect("CRD serializes");
    let targets = [
        root.join("crds").join(FILE),
        root.join("charts/stoker/crds").join(FILE),
    ];
    if std::env::var_os("UPDATE_CRDS").is_some_and(|v| v == "1") {
        for t in &targets {
            std::fs::create_dir_all(t.parent().expect("has a parent")).expect("mkdir");
            std::fs::write(t, &want).expect("write CRD");
        }
        return;
    }
    for t in &targets {
        let have = std::fs::read_to_string(t).unwrap_or_default();
        assert!(
            have == want,
            "{} is out of date with src/api: run `UPDATE_CRDS=1 cargo test -p stoker-operator --test operator_crd`",
            t.display()
        );
    }
}

mod operator_support;

use std::process::Command;
use std::time::Duration;

use kube::CustomResourceExt;
use kube::api::{Api, PostParams};
use operator_support::*;
use stoker_operator::api::DataPipeline;
use stoker_testenv::cluster::ControlPlane;

/// Every property of `schema`, below `path`, that has no description.
fn undescribed(schema: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    if schema
        .get("description")
        .and_then(|d| d.as_str())
        .is_none_or(str::is_empty)
    {
        out.push(if path.is_empty() {
            "(root)".into()
        } else {
            path.to_string()
        });
    }
    for (name, property) in schema["properties"].as_object().into_iter().flatten() {
        undescribed(property, &format!("{path}.{name}"), out);
    }
    // A list's items are no field of their own; their properties are.
    for (name, property) in schema["items"]["properties"]
        .as_object()
        .into_iter()
        .flatten()
    {
        undescribed(property, &format!("{path}[].{name}"), out);
    }
}

#[test]
fn every_crd_field_has_a_description() {
    let crd = serde_json::to_value(DataPipeline::crd()).expect("CRD as JSON");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut missing = Vec::new();
    undescribed(schema, "", &mut missing);
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:?}"
    );
    assert!(
        !schema["description"]
            .as_str()
            .unwrap_or_default()
            .starts_with("Auto-generated"),
        "the root describes a DataPipeline: {}",
        schema["description"]
    );
}

fn kubectl(cp: &ControlPlane, args: &[&str]) -> (bool, String) {
    let mut cmd: Command = cp.kubectl();
    let out = cmd.args(args).output().expect("kubectl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_explains_every_field_and_scales_a_fixed_pipeline() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("crd-scale").await;
    install_crd(&ns.client).await;

    // `kubectl explain` answers from the API server's published schema, once kubectl's
    // discovery has caught up with the CRD just installed.
    eventually(
        "kubectl to discover datapipelines",
        Duration::from_secs(60),
        || async { kubectl(cp, &["explain", "datapipeline"]).0.then_some(()) },
    )
    .await;
    for (path, says) in [
        ("datapipeline", "A fleet of stoker-loader decoders"),
        (
            "datapipeline.spec.decoders.minReplicas",
            "Fewest decoder pods",
        ),
        (
            "datapipeline.spec.autoscaling.scaleDownStabilizationSeconds",
            "before it shrinks",
        ),
        (
            "datapipeline.spec.source.s3.credentialsSecretRef.name",
            "Name of the Secret",
        ),
        ("datapipeline.status.lastScale.reason", "in numbers"),
        (
            "datapipeline.status.observed.dataWaitPercent",
            "gates the step",
        ),
    ] {
        let (ok, text) = kubectl(cp, &["explain", path]);
        // kubectl wraps descriptions at 80 columns.
        let words = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            ok && words.contains(says),
            "kubectl explain {path}:\n{text}"
        );
    }

    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("scaled", 2, 1))
        .await
        .expect("create pipeline");
    wait_ready_decoders(&ns.client, &ns.name, "scaled", 2).await;

    // `kubectl scale` sets the fixed count through the scale subresource; the operator follows.
    let (ok, text) = kubectl(
        cp,
        &["-n", &ns.name, "scale", "dp", "scaled", "--replicas", "4"],
    );
    assert!(ok, "kubectl scale:\n{text}");
    let dp = dps.get("scaled").await.expect("pipeline");
    assert_eq!(dp.spec.autoscaling.replicas, Some(4));
    wait_ready_decoders(&ns.client, &ns.name, "scaled", 4).await;
    let scale = eventually(
        "the scale's status at 4",
        Duration::from_secs(30),
        || async {
            let scale = dps.get_scale("scaled").await.ok()?;
            (scale.status.as_ref()?.replicas == 4).then_some(scale)
        },
    )
    .await;
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(4));

    // Past decoders.maxReplicas, or in another mode, the CRD's rules refuse it, saying why.
    let (ok, text) = kubectl(
        cp,
        &["-n", &ns.name, "scale", "dp", "scaled", "--replicas", "40"],
    );
    assert!(!ok && text.contains("autoscaling.replicas"), "{text}");
    let mut auto = pipeline("auto", 1, 1);
    auto.spec.autoscaling.mode = stoker_operator::api::v1alpha1::AutoscalingMode::Auto;
    auto.spec.autoscaling.replicas = None;
    dps.create(&PostParams::default(), &auto)
        .await
        .expect("create auto pipeline");
    let (ok, text) = kubectl(
        cp,
        &["-n", &ns.name, "scale", "dp", "auto", "--replicas", "3"],
    );
    assert!(
        !ok && text.contains("autoscaling.replicas applies only when autoscaling.mode is fixed"),
        "{text}"
    );
    op.stop().await;
}
