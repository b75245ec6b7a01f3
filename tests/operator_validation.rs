//! Invalid DataPipelines are refused by the real API server (schema bounds and CEL rules), each
//! with a message that names the field to fix.

mod operator_support;

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use operator_support::*;
use serde_json::{Value, json};
use stoker_operator::api::DataPipeline;
use stoker_testenv::cluster::ControlPlane;

fn base(name: &str) -> Value {
    json!({
        "apiVersion": "stoker.dev/v1alpha1",
        "kind": "DataPipeline",
        "metadata": {"name": name},
        "spec": {
            "source": {"s3": {"bucket": "train-data"}},
            "transform": {"resize": {"mode": "crop", "width": 224, "height": 224}},
            "batch": {"size": 32},
            "trainer": {"prefetchBatches": 4, "sharedMemory": "512Mi"},
            "decoders": {"minReplicas": 1, "maxReplicas": 4}
        }
    })
}

/// Sets `value` at a dotted path under the object.
fn with(mut v: Value, path: &str, value: Value) -> Value {
    let mut cur = &mut v;
    let parts: Vec<&str> = path.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        cur = cur
            .as_object_mut()
            .expect("object")
            .entry(*p)
            .or_insert(json!({}));
    }
    cur.as_object_mut()
        .expect("object")
        .insert(parts[parts.len() - 1].to_string(), value);
    v
}

fn without(mut v: Value, path: &str) -> Value {
    let mut cur = &mut v;
    let parts: Vec<&str> = path.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        cur = cur.get_mut(*p).expect("path");
    }
    cur.as_object_mut()
        .expect("object")
        .remove(parts[parts.len() - 1]);
    v
}

/// Creates untyped, so that values the Rust types would refuse reach the API server.
async fn refused(api: &Api<DynamicObject>, obj: Value) -> String {
    let dp: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    match api.create(&PostParams::default(), &dp).await {
        Err(kube::Error::Api(s)) => s.message.clone(),
        Ok(_) => panic!("accepted an invalid pipeline: {obj}"),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_pipelines_are_refused_with_a_message_naming_the_field() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-invalid").await;
    install_crd(&ns.client).await;
    let api: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    let untyped: Api<DynamicObject> = Api::namespaced_with(
        ns.client.clone(),
        &ns.name,
        &ApiResource::erase::<DataPipeline>(&()),
    );

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "min above max",
            with(base("a"), "spec.decoders.minReplicas", json!(8)),
            "decoders.minReplicas must not exceed decoders.maxReplicas",
        ),
        (
            "crop without height",
            without(base("b"), "spec.transform.resize.height"),
            "transform.resize.width and transform.resize.height are required",
        ),
        (
            "qwenSmart with width",
            with(
                with(
                    with(
                        without(base("c"), "spec.transform.resize.height"),
                        "spec.transform.resize.mode",
                        json!("qwenSmart"),
                    ),
                    "spec.transform.resize.minPixels",
                    json!(100),
                ),
                "spec.transform.resize.maxPixels",
                json!(1000),
            ),
            "do not apply to mode qwenSmart",
        ),
        (
            "patchFactor with crop",
            with(base("d"), "spec.transform.resize.patchFactor", json!(28)),
            "apply only to mode qwenSmart",
        ),
        (
            "qwenSmart pixel bounds reversed",
            with(
                with(
                    with(
                        without(
                            without(base("e"), "spec.transform.resize.width"),
                            "spec.transform.resize.height",
                        ),
                        "spec.transform.resize.mode",
                        json!("qwenSmart"),
                    ),
                    "spec.transform.resize.minPixels",
                    json!(5000),
                ),
                "spec.transform.resize.maxPixels",
                json!(1000),
            ),
            "minPixels <= transform.resize.maxPixels",
        ),
        (
            "manifest not s3",
            with(
                base("f"),
                "spec.source.manifest",
                json!("https://x/y.jsonl"),
            ),
            "source.manifest must be an s3:// URL",
        ),
        (
            "endpoint without scheme",
            with(base("g"), "spec.source.s3.endpoint", json!("minio:9000")),
            "source.s3.endpoint must start with http",
        ),
        (
            "sharedMemory not a quantity",
            with(base("h"), "spec.trainer.sharedMemory", json!("lots")),
            "trainer.sharedMemory must be a quantity",
        ),
        (
            "sharedMemory too small",
            with(base("i"), "spec.trainer.sharedMemory", json!("1Mi")),
            "trainer.sharedMemory is too small",
        ),
        (
            "off without replicas",
            with(base("j"), "spec.autoscaling", json!({"mode": "fixed"})),
            "autoscaling.replicas is required when autoscaling.mode is fixed",
        ),
        (
            "replicas outside min..max",
            with(
                base("k"),
                "spec.autoscaling",
                json!({"mode": "fixed", "replicas": 9}),
            ),
            "must lie between decoders.minReplicas and decoders.maxReplicas",
        ),
        (
            "replicas with mode auto",
            with(
                base("l"),
                "spec.autoscaling",
                json!({"mode": "auto", "replicas": 2}),
            ),
            "autoscaling.replicas applies only when autoscaling.mode is fixed",
        ),
        (
            "name too long",
            with(base("m"), "metadata.name", json!("a".repeat(45))),
            "metadata.name must be a DNS label of at most 40 characters",
        ),
        (
            "batch size zero",
            with(base("n"), "spec.batch.size", json!(0)),
            "spec.batch.size",
        ),
        (
            "bucket with capitals",
            with(base("o"), "spec.source.s3.bucket", json!("Train_Data")),
            "spec.source.s3.bucket",
        ),
        (
            "max skew zero",
            with(base("p"), "spec.decoders.spread", json!({"maxSkew": 0})),
            "spec.decoders.spread.maxSkew",
        ),
        (
            "data wait above 100%",
            with(
                base("q"),
                "spec.autoscaling.targetDataWaitPercent",
                json!(150),
            ),
            "spec.autoscaling.targetDataWaitPercent",
        ),
        (
            "unknown resize mode",
            with(base("r"), "spec.transform.resize.mode", json!("stretch")),
            "spec.transform.resize.mode",
        ),
        (
            "prefetch too deep",
            with(base("s"), "spec.trainer.prefetchBatches", json!(5000)),
            "spec.trainer.prefetchBatches",
        ),
        (
            "too many tolerations",
            with(
                base("t"),
                "spec.decoders.tolerations",
                json!(vec![json!({"operator": "Exists"}); 40]),
            ),
            "spec.decoders.tolerations",
        ),
    ];
    assert!(cases.len() >= 15);
    for (what, obj, expected) in cases {
        let message = refused(&untyped, obj).await;
        assert!(
            message.contains(expected),
            "{what}: expected {expected:?} in {message:?}"
        );
    }

    // Immutable fields: accepted on create, refused on change.
    api.create(
        &PostParams::default(),
        &serde_json::from_value(base("fixed")).expect("typed"),
    )
    .await
    .expect("valid pipeline accepted");
    for (patch, expected) in [
        (
            json!({"spec": {"batch": {"size": 64}}}),
            "batch is immutable",
        ),
        (
            json!({"spec": {"source": {"s3": {"bucket": "other-data"}}}}),
            "source.s3.bucket is immutable",
        ),
        (
            json!({"spec": {"trainer": {"sharedMemory": "1Gi"}}}),
            "trainer.sharedMemory is immutable",
        ),
    ] {
        let err = api
            .patch("fixed", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect_err("immutable field changed");
        let message = match err {
            kube::Error::Api(s) => s.message.clone(),
            e => panic!("unexpected error: {e}"),
        };
        assert!(
            message.contains(expected),
            "expected {expected:?} in {message:?}"
        );
    }
    // Scaling fields stay mutable.
    api.patch(
        "fixed",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"decoders": {"maxReplicas": 8}}})),
    )
    .await
    .expect("maxReplicas may change");
}
