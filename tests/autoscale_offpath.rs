//! The autoscaler reads Prometheus off the reconcile path: with a Prometheus that takes 10 s
//! per query (and a query timeout that lets it), a new pipeline still gets its decoders and its
//! status at once, every reconcile stays short, and the decision comes once the answer does.

mod operator_support;

use std::time::{Duration, Instant};

use kube::api::{Api, PostParams};
use operator_support::prometheus_stub::PrometheusStub;
use operator_support::*;
use stoker_operator::Config;
use stoker_operator::api::DataPipeline;
use stoker_operator::api::v1alpha1::AutoscalingMode;
use stoker_operator::autoscale::AutoscalingPolicy;
use stoker_operator::build::BuildDefaults;
use stoker_operator::signal_source::AutoscalerSettings;
use stoker_testenv::cluster::ControlPlane;

const SLOW: Duration = Duration::from_secs(10);

/// The count of reconciles that took at most `limit` seconds (the histogram's smallest bucket
/// at or above it), and the count of all of them.
fn reconciles_within(metrics: &str, limit: f64) -> (u64, u64) {
    let mut within: Option<(f64, u64)> = None;
    let mut total = 0;
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix("stoker_reconcile_duration_seconds_bucket{le=\"") {
            let (le, count) = rest.split_once("\"} ").expect("bucket line");
            let (le, count): (f64, u64) = (
                le.parse().unwrap_or(f64::INFINITY),
                count.parse().expect("count"),
            );
            if le >= limit && within.is_none_or(|(l, _)| le < l) {
                within = Some((le, count));
            }
        } else if let Some(count) = line.strip_prefix("stoker_reconcile_duration_seconds_count ") {
            total = count.parse().expect("count");
        }
    }
    (within.expect("a bucket at or above the limit").1, total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_prometheus_never_slows_a_reconcile() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("slow-prom").await;
    install_crd(&ns.client).await;
    let prometheus = PrometheusStub::start(SLOW).await;
    let config = Config {
        watch_namespace: Some(ns.name.clone()),
        lease: None,
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.to_string(),
            sidecar_resources: None,
            allowed_images: Vec::new(),
        },
        webhook: None,
        metrics_listen: None,
        installation: None,
        autoscaler: Some(AutoscalerSettings {
            prometheus_url: Some(prometheus.url()),
            period: Duration::from_secs(2),
            // Long enough that each query waits out the stub's 10 s: inline reads would hold
            // every reconcile that long.
            query_timeout: Duration::from_secs(30),
            defaults: AutoscalingPolicy {
                window: Duration::from_secs(5),
                ..AutoscalingPolicy::default()
            },
            ..AutoscalerSettings::default()
        }),
    };
    let op = Operator::start_with(ns.client.clone(), config).await;

    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut dp = pipeline("slow", 1, 1);
    dp.spec.autoscaling.mode = AutoscalingMode::Auto;
    dp.spec.autoscaling.replicas = None;
    dp.spec.decoders.min_replicas = 2;
    let created = Instant::now();
    dps.create(&PostParams::default(), &dp)
        .await
        .expect("create pipeline");

    // Before Prometheus has answered anything: the fleet at minReplicas and a status that says
    // no decision was made yet.
    let status = eventually(
        "decoders and status before Prometheus answers",
        SLOW / 2,
        || async {
            let status = dps.get("slow").await.ok()?.status?;
            (status.decoders.desired == 2).then_some(status)
        },
    )
    .await;
    let waited = created.elapsed();
    assert!(
        prometheus.queries() > 0,
        "the background read has asked Prometheus"
    );
    assert_eq!(
        prometheus.answered(),
        0,
        "no answer yet after {waited:?}: the reconcile did not wait for one"
    );
    let read = status
        .conditions
        .iter()
        .find(|c| c.type_ == "MetricsUnavailable")
        .map(|c| c.status.clone());
    assert_ne!(
        read.as_deref(),
        Some("False"),
        "no signals read yet: {:?}",
        status.conditions
    );
    assert_eq!(decoders(&ns.client, &ns.name, "slow").await.len(), 2);

    // Once the answer lands, the decision follows (signals read: MetricsUnavailable False).
    eventually("a decision on the slow answer", SLOW * 3, || async {
        let status = dps.get("slow").await.ok()?.status?;
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "MetricsUnavailable" && c.status == "False")
            .then_some(())
    })
    .await;
    assert!(prometheus.answered() > 0);

    let metrics = op.metrics.encode();
    let (within, total) = reconciles_within(&metrics, 1.0);
    assert!(total >= 2, "{metrics}");
    assert_eq!(
        within, total,
        "every reconcile took under ~1.5 s while each Prometheus query took 10 s:\n{metrics}"
    );
    op.stop().await;
}
