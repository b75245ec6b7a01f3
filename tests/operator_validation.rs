//! Invalid DataPipelines are refused by the real API server (schema bounds and CEL rules), each
//! with a message that names the field to fix.

mod operator_support;

use kube::Resource;
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

/// Creates untyped, so that values the Rust types would refuse reach the API server, with
/// `fieldValidation=Strict` as kubectl sends it (kube's `PostParams` has no such field).
async fn create_strict(
    client: &kube::Client,
    namespace: &str,
    obj: &Value,
) -> Result<DynamicObject, kube::Error> {
    let ar = ApiResource::erase::<DataPipeline>(&());
    let url = DynamicObject::url_path(&ar, Some(namespace));
    let body = serde_json::to_vec(obj).expect("json");
    let mut req = kube::core::Request::new(url)
        .create(&PostParams::default(), body)
        .expect("request");
    let uri = req.uri().to_string();
    let sep = if uri.contains('?') { '&' } else { '?' };
    *req.uri_mut() = format!("{uri}{sep}fieldValidation=Strict")
        .parse()
        .expect("uri");
    client.request(req).await
}

async fn refused(client: &kube::Client, namespace: &str, obj: Value) -> String {
    match create_strict(client, namespace, &obj).await {
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
            "source.s3.endpoint must be an http:// or https:// URL with a host",
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
    let limits: Vec<(&str, Value, &str)> = vec![
        (
            "endpoint with another scheme",
            with(
                base("u1"),
                "spec.source.s3.endpoint",
                json!("ftp://minio:21"),
            ),
            "source.s3.endpoint must be an http:// or https:// URL with a host",
        ),
        (
            "endpoint without a host",
            with(base("u2"), "spec.source.s3.endpoint", json!("http://")),
            "source.s3.endpoint must be an http:// or https:// URL with a host",
        ),
        (
            "batch above a decoder's limit",
            with(
                with(base("u3"), "spec.batch.size", json!(1025)),
                "spec.transform.resize",
                json!({"mode": "crop", "width": 8, "height": 8}),
            ),
            "batch.size must be at most 1024: a decoder refuses larger batches",
        ),
        (
            "output above a decoder's largest",
            with(
                with(base("u4"), "spec.batch.size", json!(1)),
                "spec.transform.resize",
                json!({"mode": "crop", "width": 4096, "height": 4096}),
            ),
            "transform.resize.width × height must be at most 12845056 pixels",
        ),
        (
            "qwenSmart maxPixels above a decoder's largest",
            with(
                with(base("u5"), "spec.batch.size", json!(1)),
                "spec.transform.resize",
                json!({"mode": "qwenSmart", "minPixels": 1, "maxPixels": 20000000}),
            ),
            "transform.resize.maxPixels must be at most 12845056",
        ),
        (
            "batch larger than one gRPC reply",
            with(
                with(
                    with(base("u6"), "spec.batch.size", json!(1024)),
                    "spec.trainer.sharedMemory",
                    json!("64Gi"),
                ),
                "spec.transform.resize",
                json!({"mode": "crop", "width": 448, "height": 448}),
            ),
            "must be at most 251658240 (240 MiB): a batch travels in one gRPC reply",
        ),
        (
            "node selector value not a label value",
            with(
                base("u7"),
                "spec.decoders.nodeSelector",
                json!({"pool": "has space"}),
            ),
            "decoders.nodeSelector values must be label values",
        ),
        (
            "node selector value too long for a label",
            with(
                base("u7b"),
                "spec.decoders.nodeSelector",
                json!({"pool": "a".repeat(64)}),
            ),
            "spec.decoders.nodeSelector.pool: Too long: may not be more than 63",
        ),
        (
            "node selector key not a label key",
            with(
                base("u8"),
                "spec.decoders.nodeSelector",
                json!({"bad key!": "x"}),
            ),
            "decoders.nodeSelector keys must be label keys",
        ),
        (
            "toleration value not a label value",
            with(
                base("u9"),
                "spec.decoders.tolerations",
                json!([{"key": "gpu", "operator": "Equal", "value": "not a label"}]),
            ),
            "decoders.tolerations values must be label values",
        ),
        (
            "toleration effect unknown",
            with(
                base("u10"),
                "spec.decoders.tolerations",
                json!([{"key": "gpu", "operator": "Exists", "effect": "Never"}]),
            ),
            "decoders.tolerations: effect must be NoSchedule",
        ),
        (
            "resource quantity that does not parse",
            with(
                base("u11"),
                "spec.decoders.resources",
                json!({"requests": {"cpu": "two"}}),
            ),
            "decoders.resources.requests and decoders.resources.limits must be non-negative quantities",
        ),
        (
            "requests above limits",
            with(
                base("u12"),
                "spec.decoders.resources",
                json!({"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
            ),
            "decoders.resources.requests must not exceed decoders.resources.limits",
        ),
        (
            "webDataset and a manifest",
            with(
                with(
                    base("w1"),
                    "spec.source.webDataset",
                    json!({"shards": "s3://train-data/{0..3}.tar", "index": "s3://idx/a/"}),
                ),
                "spec.source.manifest",
                json!("s3://train-data/m.jsonl"),
            ),
            "source.manifest and source.webDataset are two kinds of source",
        ),
        (
            "webDataset shards in another bucket",
            with(
                base("w2"),
                "spec.source.webDataset",
                json!({"shards": "s3://other/{0..3}.tar", "index": "s3://idx/a/"}),
            ),
            "source.webDataset.shards must lie in source.s3.bucket",
        ),
        (
            "webDataset index not a prefix",
            with(
                base("w3"),
                "spec.source.webDataset",
                json!({"shards": "s3://train-data/{0..3}.tar", "index": "s3://idx/a"}),
            ),
            "source.webDataset.index must be an s3:// prefix ending in /",
        ),
    ];
    assert!(cases.len() >= 15);
    for (what, obj, expected) in cases.into_iter().chain(limits) {
        let message = refused(&ns.client, &ns.name, obj).await;
        assert!(
            message.contains(expected),
            "{what}: expected {expected:?} in {message:?}"
        );
    }

    // Under Strict, a field the schema does not know is refused, not silently dropped.
    let message = refused(
        &ns.client,
        &ns.name,
        with(base("unknown"), "spec.batch.sise", json!(64)),
    )
    .await;
    assert!(
        message.contains("unknown field") && message.contains("spec.batch.sise"),
        "{message}"
    );
    // Values at the limits pass: integer quantities, a labelled node pool, the largest batch.
    let at_limits = with(
        with(
            with(
                with(base("at-limits"), "spec.batch.size", json!(1024)),
                "spec.transform.resize",
                json!({"mode": "crop", "width": 224, "height": 224}),
            ),
            "spec.trainer.sharedMemory",
            json!("2Gi"),
        ),
        "spec.decoders",
        json!({
            "minReplicas": 1, "maxReplicas": 4,
            "resources": {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
            "nodeSelector": {"node.kubernetes.io/pool": "decode-a"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        }),
    );
    create_strict(&ns.client, &ns.name, &at_limits)
        .await
        .expect("a pipeline at every limit is accepted");
    // Every example in examples/ is admitted as written.
    for example in [
        include_str!("../examples/objects.yaml"),
        include_str!("../examples/manifest.yaml"),
        include_str!("../examples/webdataset.yaml"),
        include_str!("../examples/parquet.yaml"),
    ] {
        let obj: Value = serde_yaml::from_str(example).expect("example parses");
        create_strict(&ns.client, &ns.name, &obj)
            .await
            .unwrap_or_else(|e| panic!("{} refused: {e}", obj["metadata"]["name"]));
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
