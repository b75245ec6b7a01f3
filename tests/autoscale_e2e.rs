//! The autoscaler end to end: the operator (in-process, deciding every 2 s) reads a real
//! Prometheus that scrapes an exporter whose series the test drives, and scales a
//! `DataPipeline` on the real control plane (KWOK nodes). A starved trainer grows the decoder
//! fleet in one step to what the policy computes, with `status.lastScale` and an Event saying
//! why; S3 throttling holds a further scale-up back; a full trainer-node NIC sets
//! `NetworkSaturated` and writes the sidecar's local-decode share on the trainer pod; a
//! Prometheus outage keeps the size.
//!
//! Needs the control plane binaries (`scripts/tools.sh`) and `prometheus` (`scripts/deps.sh`).

mod operator_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use operator_support::exporter::{Exporter, ScrapedExporter, nic_labels, pod_labels};
use operator_support::*;
use stoker_operator::Config;
use stoker_operator::api::DataPipeline;
use stoker_operator::api::v1alpha1::AutoscalingMode;
use stoker_operator::autoscale::AutoscalingPolicy;
use stoker_operator::build::BuildDefaults;
use stoker_operator::signal_source::AutoscalerSettings;
use stoker_testenv::cluster::{
    ControlPlane, restricted_container_security, restricted_pod_security,
};

const PIPELINE: &str = "imagenet";
const TRAINER: &str = "trainer-0";
/// Prometheus scrapes every second; rates over 5 s; a decision every 2 s.
const WINDOW: Duration = Duration::from_secs(5);
const PERIOD: Duration = Duration::from_secs(2);
const MAX_REPLICAS: i32 = 8;

/// The trainer waits for data 60% of its wall time while its sidecar delivers 130 samples/s.
const DATA_WAIT: f64 = 0.6;
const DELIVERED: f64 = 130.0;
/// One decoder, its 4 threads always busy, returns 60 samples/s.
const DECODER_RATE: f64 = 60.0;
const THREADS: f64 = 4.0;
const S3_GETS_PER_SAMPLE: f64 = 2.0;
/// 448×448 RGB out, the JPEG in.
const DECODED: f64 = 602_112.0;
const ENCODED: f64 = 100_000.0;
/// Every NIC carries 1 MB/s of its 25 Gb/s: far from any limit.
const NIC_BYTES: f64 = 1.0e6;
/// The trainer node's link in the NIC phase, bytes/s: small enough for the trainer's demand.
const TRAINER_LINK: f64 = 250.0e6;

/// Decoders the policy asks for: the trainers' demand unstarved, `delivered ÷ (1 − wait)`, with
/// the default headroom, over one decoder's rate.
fn decoders_needed(delivered: f64) -> i32 {
    let demand = delivered / (1.0 - DATA_WAIT);
    (demand * AutoscalingPolicy::default().headroom / DECODER_RATE).ceil() as i32
}

fn trainer_labels(ns: &str) -> String {
    pod_labels(ns, PIPELINE, TRAINER, "trainer")
}

fn decoder_labels(ns: &str, pod: &str) -> String {
    pod_labels(ns, PIPELINE, pod, "decoder")
}

/// What node-exporter says of every simulated node: a quiet NIC and its link speed.
fn drive_nodes(exporter: &Exporter, cp: &ControlPlane) {
    for node in cp.nodes() {
        let nic = nic_labels(&node.name, "eth0");
        exporter.counter("node_network_receive_bytes_total", &nic, NIC_BYTES);
        exporter.counter("node_network_transmit_bytes_total", &nic, NIC_BYTES);
        let link = f64::from(node.nic_gbps) * 1.0e9 / 8.0;
        exporter.gauge("node_network_speed_bytes", &nic, link);
    }
}

/// A decoder at full busy: `DECODER_RATE` samples/s, S3 GETs and no throttling.
fn drive_decoder(exporter: &Exporter, ns: &str, pod: &str) {
    let l = decoder_labels(ns, pod);
    exporter.counter("stoker_loader_samples_out_total", &l, DECODER_RATE);
    exporter.counter("stoker_loader_busy_seconds_total", &l, THREADS);
    exporter.gauge("stoker_loader_pool_threads", &l, THREADS);
    exporter.counter("stoker_loader_bytes_out_total", &l, DECODER_RATE * DECODED);
    exporter.counter("stoker_loader_bytes_in_total", &l, DECODER_RATE * ENCODED);
    exporter.counter(
        "stoker_loader_s3_requests_total",
        &format!(r#"{l},op="get""#),
        DECODER_RATE * S3_GETS_PER_SAMPLE,
    );
    exporter.counter("stoker_loader_s3_throttles_total", &l, 0.0);
}

/// A trainer of the pipeline as the operator finds it: the pipeline and role labels on a pod
/// on a GPU node, marked as injected (the webhook is not part of this test).
fn trainer_pod() -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": TRAINER,
            "labels": {"stoker.dev/pipeline": PIPELINE, "stoker.dev/role": "trainer"},
            "annotations": {"stoker.dev/world-size": "1", "stoker.dev/injected": "true"},
        },
        "spec": {
            "nodeSelector": {"stoker.dev/pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            // The namespace enforces the restricted Pod Security Standard.
            "securityContext": restricted_pod_security(1000),
            "containers": [{"name": "train", "image": "registry.invalid/trainer:test",
                            "securityContext": restricted_container_security()}],
        },
    }))
    .expect("trainer pod")
}

fn condition(dp: &DataPipeline, type_: &str) -> Option<Condition> {
    dp.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

/// "…: need 325/s at 60/s per decoder → 7" → (325, 60, 7).
fn need(reason: &str) -> Option<(f64, f64, i32)> {
    let (_, rest) = reason.split_once("need ")?;
    let (demand, rest) = rest.split_once("/s at ")?;
    let (rate, rest) = rest.split_once("/s per decoder → ")?;
    let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let number = |s: &str| s.replace(',', "").parse::<f64>().ok();
    Some((number(demand)?, number(rate)?, n.parse().ok()?))
}

fn within(actual: f64, expected: f64, tolerance: f64) -> bool {
    (actual - expected).abs() <= tolerance * expected
}

async fn serving_decoders(client: &kube::Client, ns: &str) -> Vec<Pod> {
    decoders(client, ns, PIPELINE)
        .await
        .into_iter()
        .filter(|p| !is_draining(p))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starved_trainer_scales_decoders_from_prometheus_signals() {
    let started = Instant::now();
    let step = |what: &str| eprintln!("[{:>5.1}s] {what}", started.elapsed().as_secs_f64());
    let expected = decoders_needed(DELIVERED);
    assert_eq!(expected, 7, "⌈130 ÷ 0.4 × 1.2 ÷ 60⌉ = ⌈6.5⌉");
    assert!(expected <= MAX_REPLICAS);

    let cp = ControlPlane::shared();
    let ns = cp.namespace("autoscale").await;
    install_crd(&ns.client).await;
    let scraped = ScrapedExporter::start().await;
    let exporter = &scraped.exporter;
    drive_nodes(exporter, cp);
    // The trainer's series are steady before the operator knows the trainer: a series that
    // starts inside the rate window reads low, and the scale-up would come in several steps.
    exporter.counter(
        "stoker_trainer_data_wait_seconds_total",
        &trainer_labels(&ns.name),
        DATA_WAIT,
    );
    exporter.counter(
        "stoker_sidecar_samples_delivered_total",
        &trainer_labels(&ns.name),
        DELIVERED,
    );
    step("control plane, CRD, Prometheus");

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
            prometheus_url: Some(scraped.prometheus.url()),
            period: PERIOD,
            query_timeout: Duration::from_secs(2),
            defaults: AutoscalingPolicy {
                window: WINDOW,
                ..AutoscalingPolicy::default()
            },
            ..AutoscalerSettings::default()
        }),
    };
    let op = Operator::start_with(ns.client.clone(), config).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut dp = pipeline(PIPELINE, 1, 3);
    dp.spec.autoscaling.mode = AutoscalingMode::Auto;
    dp.spec.autoscaling.replicas = None;
    dp.spec.decoders.max_replicas = MAX_REPLICAS;
    dps.create(&PostParams::default(), &dp)
        .await
        .expect("create pipeline");

    // No trainer yet: minReplicas. The one decoder runs at full busy from now on.
    let first = wait_ready_decoders(&ns.client, &ns.name, PIPELINE, 1).await;
    let decoder = first[0].name_any();
    drive_decoder(exporter, &ns.name, &decoder);
    let full_window = |promql: String, expected: f64| {
        let scraped = &scraped;
        async move {
            let v = scraped.value(&promql).await?;
            within(v, expected, 0.03).then_some(())
        }
    };
    eventually(
        "Prometheus' window full of the decoder's and the trainer's samples",
        Duration::from_secs(30),
        || async {
            let w = WINDOW.as_secs();
            full_window(
                format!(r#"rate(stoker_loader_samples_out_total{{pod="{decoder}"}}[{w}s])"#),
                DECODER_RATE,
            )
            .await?;
            full_window(
                format!(r#"rate(stoker_trainer_data_wait_seconds_total{{pod="{TRAINER}"}}[{w}s])"#),
                DATA_WAIT,
            )
            .await
        },
    )
    .await;
    let before = dps.get(PIPELINE).await.expect("pipeline");
    let status = before.status.as_ref().expect("status");
    assert_eq!(status.decoders.desired, 1, "no trainer: minReplicas");
    assert!(status.last_scale.is_none(), "{:?}", status.last_scale);
    step("one decoder, its series in Prometheus");

    // The trainer appears, starved: one decision takes the fleet from 1 to 7.
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    pods.create(&PostParams::default(), &trainer_pod())
        .await
        .expect("create trainer");
    let seen = std::sync::Mutex::new(BTreeSet::new());
    let scaled = eventually(
        "the autoscaler to scale the decoders",
        Duration::from_secs(20),
        || async {
            let dp = dps.get(PIPELINE).await.ok()?;
            let desired = dp.status.as_ref()?.decoders.desired;
            seen.lock().unwrap().insert(desired);
            (desired != 1).then_some(dp)
        },
    )
    .await;
    let status = scaled.status.clone().expect("status");
    assert_eq!(
        status.decoders.desired, expected,
        "one step to the policy's count: {:?}",
        status.last_scale
    );
    assert_eq!(
        seen.into_inner().unwrap(),
        BTreeSet::from([1, expected]),
        "desired counts seen"
    );
    let last = status.last_scale.clone().expect("status.lastScale");
    assert_eq!((last.from, last.to), (1, expected), "{}", last.reason);
    assert!(
        last.reason.starts_with("data wait ") && last.reason.contains("> 5%"),
        "the reason names the data wait over its target: {}",
        last.reason
    );
    let (demand, rate, n) =
        need(&last.reason).unwrap_or_else(|| panic!("no need in {:?}", last.reason));
    assert_eq!(n, expected, "{}", last.reason);
    // Every rate comes from the same scrapes, so timing skews them alike: the decoder rate is a
    // ratio (exact), the demand moves with the data wait.
    assert!(within(rate, DECODER_RATE, 0.03), "{}", last.reason);
    assert!(
        within(demand, DELIVERED / (1.0 - DATA_WAIT), 0.08),
        "{}",
        last.reason
    );
    let observed = status.observed.clone().expect("status.observed");
    assert!(
        observed
            .data_wait_percent
            .is_some_and(|w| within(w, DATA_WAIT * 100.0, 0.05)),
        "{observed:?}"
    );
    assert!(
        observed
            .samples_per_second
            .is_some_and(|s| within(s, DELIVERED, 0.05)),
        "{observed:?}"
    );
    let starved = condition(&scaled, "Starved").expect("Starved");
    assert_eq!(
        (starved.status.as_str(), starved.reason.as_str()),
        ("True", "DataWaitAboveTarget")
    );
    let grown = wait_ready_decoders(&ns.client, &ns.name, PIPELINE, expected as usize).await;
    assert!(
        grown.iter().any(|p| p.name_any() == decoder),
        "the first decoder keeps running"
    );
    let events: Api<Event> = Api::namespaced(ns.client.clone(), &ns.name);
    let decision_events = || async {
        events
            .list(&ListParams::default())
            .await
            .expect("list events")
            .items
            .into_iter()
            .filter(|e| {
                e.involved_object.kind.as_deref() == Some("DataPipeline")
                    && e.involved_object.name.as_deref() == Some(PIPELINE)
                    && e.reason.as_deref() == Some("AutoscalerDecision")
            })
            .filter_map(|e| e.message)
            .collect::<Vec<String>>()
    };
    let messages = decision_events().await;
    assert!(
        messages.contains(&last.reason),
        "an AutoscalerDecision Event says {:?}; events: {messages:?}",
        last.reason
    );
    step("scaled 1 → 7 in one decision; status, Event");

    // S3 answers 10% of the GETs with SlowDown: the fleet must not grow, even when the trainer
    // would need more decoders.
    exporter.counter(
        "stoker_loader_s3_throttles_total",
        &decoder_labels(&ns.name, &decoder),
        0.1 * DECODER_RATE * S3_GETS_PER_SAMPLE,
    );
    eventually("S3Throttled", Duration::from_secs(20), || async {
        let dp = dps.get(PIPELINE).await.ok()?;
        let c = condition(&dp, "S3Throttled")?;
        (c.status == "True").then_some(())
    })
    .await;
    let delivered = DELIVERED + 40.0;
    assert_eq!(decoders_needed(delivered), 9, "⌈170 ÷ 0.4 × 1.2 ÷ 60⌉");
    exporter.counter(
        "stoker_sidecar_samples_delivered_total",
        &trainer_labels(&ns.name),
        delivered,
    );
    let held = eventually(
        "a decision that would scale up but for S3",
        Duration::from_secs(20),
        || async {
            let dp = dps.get(PIPELINE).await.ok()?;
            let c = condition(&dp, "S3Throttled")?;
            let (_, _, n) = need(&c.message)?;
            (c.status == "True" && n == decoders_needed(delivered)).then_some((dp, c))
        },
    )
    .await;
    let (dp, throttled) = held;
    assert_eq!(throttled.reason, "SlowDown");
    assert!(
        throttled
            .message
            .contains("of requests > 1%: not scaling up"),
        "{}",
        throttled.message
    );
    let status = dp.status.expect("status");
    assert_eq!(status.decoders.desired, expected, "{}", throttled.message);
    assert_eq!(
        status.last_scale.as_ref(),
        Some(&last),
        "no scale since 1 → 7"
    );
    assert_eq!(
        serving_decoders(&ns.client, &ns.name).await.len(),
        expected as usize
    );
    let messages = decision_events().await;
    assert!(
        messages.iter().all(|m| !m.contains("S3")),
        "no scaling decision while throttled: {messages:?}"
    );
    step("S3 throttled: held at 7 where 9 were needed");

    // The trainer node's own NIC fills (a 250 MB/s link at 95%): more decoders cannot help, so
    // the sidecar is told to decode a share itself, through its pod's annotation.
    let trainer_node = pods
        .get(TRAINER)
        .await
        .expect("trainer")
        .spec
        .and_then(|s| s.node_name)
        .expect("trainer scheduled");
    let trainer_nic = nic_labels(&trainer_node, "eth0");
    exporter.gauge("node_network_speed_bytes", &trainer_nic, TRAINER_LINK);
    exporter.counter(
        "node_network_receive_bytes_total",
        &trainer_nic,
        0.95 * TRAINER_LINK,
    );
    let share = eventually(
        "the trainer pod's local-share annotation",
        Duration::from_secs(30),
        || async {
            let pod = pods.get(TRAINER).await.ok()?;
            let share: f64 = pod
                .annotations()
                .get("stoker.dev/local-share")?
                .parse()
                .ok()?;
            (share > 0.0).then_some(share)
        },
    )
    .await;
    // The share that brings the node under the limit: demand × (decoded − share × (decoded −
    // encoded)) = 80% of the link.
    let demand = delivered / (1.0 - DATA_WAIT);
    let relieving = (demand * DECODED - 0.8 * TRAINER_LINK) / (demand * (DECODED - ENCODED));
    // Rates from scrapes skew the demand by a few percent, and the share moves ~0.02 per 1%.
    assert!(
        (share - relieving).abs() < 0.1,
        "share {share}, want {relieving:.3}"
    );
    // The annotation is patched before the decision's status is written: wait for the status.
    let dp = eventually("NetworkSaturated=True", Duration::from_secs(30), || async {
        let dp = dps.get(PIPELINE).await.ok()?;
        let saturated = condition(&dp, "NetworkSaturated")?;
        (saturated.status == "True").then_some(dp)
    })
    .await;
    let saturated = condition(&dp, "NetworkSaturated").expect("NetworkSaturated");
    assert!(
        saturated.message.contains(&trainer_node),
        "the condition names the node: {}",
        saturated.message
    );
    assert_eq!(
        dp.status.as_ref().map(|s| s.decoders.desired),
        Some(expected),
        "no scale-up behind a full trainer NIC"
    );
    step("trainer NIC full: NetworkSaturated, local share in the pod's annotation");

    // Prometheus goes away: the size stays, and the status says the signals are missing.
    tokio::task::block_in_place(|| scraped.stop_prometheus());
    let dp = eventually("MetricsUnavailable", Duration::from_secs(20), || async {
        let dp = dps.get(PIPELINE).await.ok()?;
        let c = condition(&dp, "MetricsUnavailable")?;
        (c.status == "True").then_some(dp)
    })
    .await;
    let unavailable = condition(&dp, "MetricsUnavailable").expect("MetricsUnavailable");
    assert_eq!(
        unavailable.message,
        format!("Prometheus unreachable: keeping {expected} decoders")
    );
    let s3 = condition(&dp, "S3Throttled").expect("S3Throttled");
    assert_eq!(s3.status, "Unknown", "nothing is known without signals");
    assert_eq!(
        dp.status.as_ref().map(|s| s.decoders.desired),
        Some(expected)
    );
    tokio::time::sleep(PERIOD * 2).await;
    let dp = dps.get(PIPELINE).await.expect("pipeline");
    assert_eq!(
        dp.status.as_ref().map(|s| s.decoders.desired),
        Some(expected)
    );
    assert_eq!(
        serving_decoders(&ns.client, &ns.name).await.len(),
        expected as usize
    );
    step("Prometheus gone: MetricsUnavailable, still 7");

    op.stop().await;
}
