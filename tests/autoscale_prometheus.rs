//! The autoscaler's query layer against a real Prometheus server: the test exporter
//! (`operator_support::exporter`) serves the sidecar, loader and node-exporter series with
//! counters growing at known rates, Prometheus scrapes it every second, and
//! `PrometheusSignals::read` must return those rates.
//!
//! Needs the `prometheus` binary (Debian's package; `scripts/deps.sh` installs it), or its
//! path in `STOKER_PROMETHEUS_BIN`.

mod operator_support;

use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use operator_support::exporter::{Exporter, ScrapedExporter};
use stoker_operator::api::PipelineKey;
use stoker_operator::autoscale::SignalScope;
use stoker_operator::autoscale::{Autoscaler, AutoscalingPolicy, DecoderFleet, Signals};
use stoker_operator::signal_source::prometheus::{PrometheusSignals, QueryTemplates};

const NS: &str = "training";
const PIPELINE: &str = "qwen";
const DECODED: f64 = 602_112.0;
const ENCODED: f64 = 100_000.0;

/// One counter: its labels and how fast it grows per second.
struct Series {
    name: &'static str,
    labels: String,
    per_second: f64,
}

fn series(name: &'static str, labels: &str, per_second: f64) -> Series {
    Series {
        name,
        labels: labels.to_string(),
        per_second,
    }
}

fn pod_labels(pipeline: &str, pod: &str, role: &str) -> String {
    operator_support::exporter::pod_labels(NS, pipeline, pod, role)
}

/// What the exporter serves: two trainers (trainer-0's sidecar serving ranks 0 and 1, trainer-1
/// rank 2, stuck waiting), two decoders of the pipeline, one decoder of another pipeline that
/// must not count, and two nodes' NICs plus a loopback that must not count.
fn exposition() -> (Vec<Series>, Vec<(&'static str, String, f64)>) {
    let t0 = pod_labels(PIPELINE, "trainer-0", "trainer");
    let t1 = pod_labels(PIPELINE, "trainer-1", "trainer");
    let a = pod_labels(PIPELINE, "decoder-a", "decoder");
    let b = pod_labels(PIPELINE, "decoder-b", "decoder");
    let other = pod_labels("other", "decoder-x", "decoder");
    let counters = vec![
        series(
            "stoker_trainer_data_wait_seconds_total",
            &format!(r#"{t0},rank="0""#),
            0.2,
        ),
        series(
            "stoker_trainer_data_wait_seconds_total",
            &format!(r#"{t0},rank="1""#),
            0.3,
        ),
        series(
            "stoker_trainer_data_wait_seconds_total",
            &format!(r#"{t1},rank="2""#),
            1.0,
        ),
        series("stoker_sidecar_samples_delivered_total", &t0, 100.0),
        series("stoker_sidecar_samples_delivered_total", &t1, 140.0),
        series("stoker_loader_samples_out_total", &a, 60.0),
        series("stoker_loader_samples_out_total", &b, 80.0),
        series("stoker_loader_samples_out_total", &other, 5000.0),
        series("stoker_loader_busy_seconds_total", &a, 2.0),
        series("stoker_loader_busy_seconds_total", &b, 3.0),
        series("stoker_loader_busy_seconds_total", &other, 4.0),
        series("stoker_loader_bytes_out_total", &a, 60.0 * DECODED),
        series("stoker_loader_bytes_out_total", &b, 80.0 * DECODED),
        series("stoker_loader_bytes_in_total", &a, 60.0 * ENCODED),
        series("stoker_loader_bytes_in_total", &b, 80.0 * ENCODED),
        series("stoker_loader_s3_throttles_total", &a, 0.5),
        series("stoker_loader_s3_throttles_total", &b, 1.0),
        series("stoker_loader_s3_throttles_total", &other, 50.0),
        series(
            "stoker_loader_s3_requests_total",
            &format!(r#"{a},op="get""#),
            100.0,
        ),
        series(
            "stoker_loader_s3_requests_total",
            &format!(r#"{b},op="get""#),
            200.0,
        ),
        series(
            "node_network_receive_bytes_total",
            r#"device="eth0",node="cpu-1""#,
            1.0e6,
        ),
        series(
            "node_network_transmit_bytes_total",
            r#"device="eth0",node="cpu-1""#,
            8.0e8,
        ),
        series(
            "node_network_receive_bytes_total",
            r#"device="lo",node="cpu-1""#,
            9.0e9,
        ),
        series(
            "node_network_receive_bytes_total",
            r#"device="ens5",node="gpu-1""#,
            5.0e8,
        ),
        series(
            "node_network_transmit_bytes_total",
            r#"device="ens5",node="gpu-1""#,
            1.0e6,
        ),
        // A node of another workload whose NIC is busy: new decoders must avoid it too.
        series(
            "node_network_transmit_bytes_total",
            r#"device="eth0",node="cpu-9""#,
            1.125e9,
        ),
    ];
    let gauges = vec![
        ("stoker_loader_pool_threads", a.clone(), 4.0),
        ("stoker_loader_pool_threads", b.clone(), 4.0),
        ("stoker_loader_pool_threads", other.clone(), 4.0),
        (
            "node_network_speed_bytes",
            r#"device="eth0",node="cpu-1""#.to_string(),
            1.25e9,
        ),
        (
            "node_network_speed_bytes",
            r#"device="eth0",node="cpu-9""#.to_string(),
            1.25e9,
        ),
    ];
    (counters, gauges)
}

/// Sets every series on the exporter, counters growing from now.
fn drive(exporter: &Exporter) {
    let (counters, gauges) = exposition();
    for s in counters {
        exporter.counter(s.name, &s.labels, s.per_second);
    }
    for (name, labels, value) in gauges {
        exporter.gauge(name, &labels, value);
    }
}

/// Successful scrapes of the exporter in the last 8 seconds: 8 means the 5 s window and the
/// scrape that lags behind it hold only real samples.
async fn scraped_seconds(scraped: &ScrapedExporter) -> f64 {
    scraped.value("sum_over_time(up[8s])").await.unwrap_or(0.0)
}

fn free_port() -> u16 {
    stoker_testenv::net::free_port().expect("a free port")
}

fn close(actual: Option<f64>, expected: f64, what: &str) {
    let v = actual.unwrap_or_else(|| panic!("{what}: absent"));
    assert!(
        (v - expected).abs() <= 0.03 * expected.abs().max(1e-9),
        "{what}: {v} is not {expected} ± 3%"
    );
}

fn complete(s: &Signals) -> bool {
    s.data_wait_share.is_some()
        && s.consumption_per_second.is_some()
        && s.decoders.len() == 2
        && s.decoders.values().all(|d| d.busy_share > 0.0)
        && s.nodes
            .get("cpu-1")
            .is_some_and(|n| n.link_bytes_per_second.is_some())
        && s.s3_requests_per_second.is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_from_a_real_prometheus() {
    let scraped = ScrapedExporter::start().await;
    drive(&scraped.exporter);
    let reader = PrometheusSignals::new(
        &scraped.prometheus.url(),
        QueryTemplates::default(),
        Duration::from_secs(2),
    )
    .expect("client");
    let scope = SignalScope {
        namespace: NS.to_string(),
        pipeline: PIPELINE.to_string(),
        trainer_pods: vec!["trainer-0".into(), "trainer-1".into()],
        nodes: vec!["cpu-1".into(), "gpu-1".into()],
        window: Duration::from_secs(5),
    };

    // Prometheus needs a few scrapes before rate() has two samples of every series.
    let deadline = Instant::now() + Duration::from_secs(25);
    let signals = loop {
        match reader.read(&scope).await {
            // rate() divides by the whole window: it must hold only scraped samples.
            Ok(s) if complete(&s) && scraped_seconds(&scraped).await >= 8.0 => {
                break s;
            }
            last => {
                if Instant::now() > deadline {
                    let log = scraped.prometheus.log_tail(30);
                    panic!("no complete signals within 25 s: {last:?}\nPrometheus log:\n{log}");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };

    close(
        signals.data_wait_share,
        0.3,
        "data wait (ranks at 20%, 30% and 100%: the single worst set aside)",
    );
    close(
        signals.consumption_per_second,
        240.0,
        "consumption (100 + 140)",
    );
    assert_eq!(signals.trainers_reporting, Some(3), "ranks reporting");
    // The README's dashboard expression reads what the operator decides on.
    let dashboard = scraped
        .value(&format!(
            r#"bottomk by (namespace, pipeline) (1, topk by (namespace, pipeline) (2, rate(stoker_trainer_data_wait_seconds_total{{namespace="{NS}",pipeline="{PIPELINE}"}}[5s])))"#
        ))
        .await;
    close(dashboard, 0.3, "the README's dashboard data wait");
    assert_eq!(
        signals.gpu_utilization_percent, None,
        "no dcgm-exporter: absent, no error"
    );
    let pods: Vec<&str> = signals.decoders.keys().map(String::as_str).collect();
    assert_eq!(
        pods,
        ["decoder-a", "decoder-b"],
        "only this pipeline's decoders"
    );
    close(
        Some(signals.decoders["decoder-a"].samples_per_second),
        60.0,
        "decoder-a rate",
    );
    close(
        Some(signals.decoders["decoder-a"].busy_share),
        0.5,
        "decoder-a busy (2 s/s of 4 threads)",
    );
    close(
        Some(signals.decoders["decoder-b"].busy_share),
        0.75,
        "decoder-b busy",
    );
    close(
        signals.decoded_bytes_per_sample,
        DECODED,
        "decoded bytes per sample",
    );
    close(
        signals.encoded_bytes_per_sample,
        ENCODED,
        "encoded bytes per sample",
    );
    close(
        signals.s3_throttles_per_second,
        1.5,
        "S3 throttles of this pipeline",
    );
    close(signals.s3_requests_per_second, 300.0, "S3 requests");
    let cpu = signals.nodes["cpu-1"];
    close(
        Some(cpu.receive_bytes_per_second),
        1.0e6,
        "cpu-1 receive without loopback",
    );
    close(Some(cpu.transmit_bytes_per_second), 8.0e8, "cpu-1 transmit");
    assert_eq!(cpu.link_bytes_per_second, Some(1.25e9));
    let gpu = signals.nodes["gpu-1"];
    close(Some(gpu.receive_bytes_per_second), 5.0e8, "gpu-1 receive");
    assert_eq!(
        gpu.link_bytes_per_second, None,
        "no speed series: the annotation or default applies"
    );

    // The signals drive a decision: data wait 30% > 5%, demand 240 ÷ 0.7 = 343/s, 140 samples/s
    // over 1.25 busy decoders = 112/s each: 343 × 1.2 ÷ 112 → 4 decoders. cpu-1 sends 64% of its
    // link: under the 80% limit, nothing is moved; cpu-9, at 90%, takes no new decoder.
    let fleet = DecoderFleet {
        replicas: 2,
        pods: [("decoder-a", "cpu-1"), ("decoder-b", "cpu-1")]
            .into_iter()
            .map(|(p, n)| (p.to_string(), n.to_string()))
            .collect(),
        trainers: 2,
        trainer_nodes: [("gpu-1".to_string(), 2)].into_iter().collect(),
        node_link_bytes_per_second: [("gpu-1".to_string(), 12.5e9)].into_iter().collect(),
    };
    let policy = AutoscalingPolicy {
        min_replicas: 1,
        max_replicas: 10,
        ..AutoscalingPolicy::default()
    };
    let d = Autoscaler::default().step(
        &PipelineKey::new("training", "qwen"),
        &policy,
        &fleet,
        Some(&signals),
        Timestamp::now(),
    );
    assert_eq!(d.replicas, 4, "{}", d.reason);
    assert!(d.conditions.starved && !d.conditions.metrics_unavailable);
    assert!(d.move_pods.is_empty(), "{d:?}");
    assert_eq!(d.avoid_nodes, ["cpu-9"]);
    let nic = d
        .observed
        .max_nic_utilization_percent
        .expect("NIC utilization");
    assert!(
        (nic - 64.0).abs() < 2.0,
        "the pipeline's busiest NIC is cpu-1's: {nic}"
    );
}

#[tokio::test]
async fn prometheus_unreachable_keeps_the_size() {
    let port = free_port();
    let reader = PrometheusSignals::new(
        &format!("http://127.0.0.1:{port}"),
        QueryTemplates::default(),
        Duration::from_secs(2),
    )
    .expect("client");
    let scope = SignalScope {
        namespace: NS.to_string(),
        pipeline: PIPELINE.to_string(),
        trainer_pods: vec![],
        nodes: vec![],
        window: Duration::from_secs(60),
    };
    let err = reader
        .read(&scope)
        .await
        .expect_err("nothing listens there");
    assert_eq!(err.category(), "prometheus_unreachable", "{err}");

    let fleet = DecoderFleet {
        replicas: 7,
        trainers: 4,
        ..DecoderFleet::default()
    };
    let d = Autoscaler::default().step(
        &PipelineKey::new("training", "qwen"),
        &AutoscalingPolicy::default(),
        &fleet,
        None,
        Timestamp::now(),
    );
    assert_eq!(d.replicas, 7, "{}", d.reason);
    let unavailable = d
        .condition_reports()
        .into_iter()
        .find(|c| c.type_ == "MetricsUnavailable")
        .expect("the condition is reported");
    assert_eq!(unavailable.status, "True");
}
