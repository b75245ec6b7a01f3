//! Scale bench (not a test): many DataPipelines against a real control plane with KWOK nodes,
//! the operator as its own process (the real binary), so that its RSS is its own.
//!
//! `cargo bench -p stoker-operator --bench operator_scale` (release) or, faster to build,
//! `cargo bench -p stoker-operator --bench operator_scale --profile dev`.
//! Sizes: STOKER_BENCH_PIPELINES (default 500), STOKER_BENCH_REPLICAS (default 10).
//!
//! Reports: reconcile p50/p99 (from the operator's own histogram), apply→Ready per pipeline
//! (p50/p99/max, and until all are Ready), and the operator's peak and final RSS.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{CustomResourceExt, ResourceExt};
use stoker_operator::api::DataPipeline;
use stoker_testenv::cluster::{ControlPlane, Options, PodsEverSeen};
use stoker_testenv::nodes::{Pool, SimNode, default_nodes};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pipeline(name: &str, replicas: usize) -> DataPipeline {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "stoker.dev/v1alpha1", "kind": "DataPipeline",
        "metadata": {"name": name},
        "spec": {
            "source": {"s3": {"bucket": "bench-data"}},
            "transform": {"resize": {"mode": "crop", "width": 224, "height": 224}},
            "batch": {"size": 32},
            "trainer": {"prefetchBatches": 2, "sharedMemory": "64Mi"},
            "decoders": {
                "minReplicas": 1, "maxReplicas": 100, "drainSeconds": 5,
                "nodeSelector": {"stoker.dev/pool": "cpu"},
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}
            },
            "autoscaling": {"mode": "fixed", "replicas": replicas}
        }
    }))
    .expect("pipeline")
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// histogram_quantile over the operator's reconcile histogram (text exposition).
fn histogram_quantile(metrics: &str, q: f64) -> Option<f64> {
    let mut buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with("stoker_reconcile_duration_seconds_bucket"))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let count = l.split_whitespace().last()?.parse().ok()?;
            Some((le, count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for (le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let width = count - prev.1;
            let frac = if width > 0.0 {
                (rank - prev.1) / width
            } else {
                0.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    None
}

async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = s
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

struct Operator(Child);

fn free_port() -> u16 {
    stoker_testenv::net::free_port().expect("port")
}

/// The real operator binary, watching `ns`, with its metrics on `metrics_port`.
fn start_operator(cp: &ControlPlane, ns: &str, metrics_port: u16) -> Operator {
    let child = Command::new(env!("CARGO_BIN_EXE_stoker-operator"))
        .args([
            "run",
            "--namespace",
            ns,
            "--watch-namespace",
            ns,
            "--no-webhook",
            "--identity",
            "bench-0",
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
        ])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("operator");
    Operator(child)
}

/// A counter's value in the text exposition (the sum over its label sets).
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .fold(0.0, |sum, v| sum + v)
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main]
async fn main() {
    let pipelines = env_usize("STOKER_BENCH_PIPELINES", 500);
    let replicas = env_usize("STOKER_BENCH_REPLICAS", 10);
    let pods = pipelines * replicas;
    // KWOK nodes hold 110 pods each: enough CPU nodes for the whole fleet, plus slack.
    let cpu_nodes = (pods / 100 + 1).max(8);
    let mut nodes: Vec<SimNode> = default_nodes()
        .into_iter()
        .filter(|n| n.pool == Pool::Gpu)
        .collect();
    nodes.extend((0..cpu_nodes).map(|i| SimNode {
        name: format!("cpu-{i}"),
        pool: Pool::Cpu,
        zone: stoker_testenv::nodes::ZONES[i % 2],
        instance_type: "c7i.8xlarge",
        cpu: 64,
        memory_gi: 128,
        gpus: 0,
        nic_gbps: 25,
    }));
    eprintln!(
        "bench: {pipelines} pipelines × {replicas} decoders = {pods} pods on {cpu_nodes} CPU nodes"
    );
    let started = Instant::now();
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(Options { dir: None, nodes }))
        .await
        .expect("join")
        .expect("control plane");
    eprintln!(
        "control plane up in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let client = cp.client().await.expect("client");

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "datapipelines.stoker.dev",
        &PatchParams::apply("bench").force(),
        &Patch::Apply(&DataPipeline::crd()),
    )
    .await
    .expect("CRD");
    let ns = "bench";
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(ns.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .expect("namespace");
    tokio::time::sleep(Duration::from_secs(3)).await;

    let metrics_port = free_port();
    let operator = start_operator(&cp, ns, metrics_port);

    let pid = operator.0.id();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = rss_kib(pid).unwrap_or(0);

    // Watch readiness of every pipeline while creating them.
    let dps: Api<DataPipeline> = Api::namespaced(client.clone(), ns);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
    let watch = tokio::spawn({
        let dps = dps.clone();
        async move {
            let mut stream = watcher(dps, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(dp)) = stream.next().await {
                let ready = dp.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                });
                if ready {
                    let _ = tx.send((dp.name_any(), Instant::now()));
                }
            }
        }
    });
    // Every decoder pod that ever exists: a reconcile reading a cache that lags its own creates
    // would make more than asked for (and delete the surplus later).
    let decoders_ever = PodsEverSeen::watch(&client, ns, "stoker.dev/role=decoder").await;
    let mut created: BTreeMap<String, Instant> = BTreeMap::new();
    let t0 = Instant::now();
    for i in 0..pipelines {
        let name = format!("p{i:04}");
        dps.create(&PostParams::default(), &pipeline(&name, replicas))
            .await
            .expect("create pipeline");
        created.insert(name, Instant::now());
    }
    eprintln!(
        "created {pipelines} pipelines in {:.1}s",
        t0.elapsed().as_secs_f64()
    );

    let mut ready: BTreeMap<String, Duration> = BTreeMap::new();
    let mut peak_rss = idle_rss;
    let deadline =
        Instant::now() + Duration::from_secs(env_usize("STOKER_BENCH_TIMEOUT_S", 1500) as u64);
    while ready.len() < pipelines && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(1), rx.recv()).await {
            Ok(Some((name, at))) => {
                if let Some(c) = created.get(&name) {
                    ready.entry(name).or_insert_with(|| at.duration_since(*c));
                }
            }
            Ok(None) => break,
            Err(_) => {}
        }
        peak_rss = peak_rss.max(rss_kib(pid).unwrap_or(0));
        if ready.len().is_multiple_of(50) {
            eprint!(
                "\rready {}/{pipelines} after {:.0}s   ",
                ready.len(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    let all_ready = t0.elapsed();
    eprintln!();
    // Let the operator settle (status writes, resyncs) and sample RSS once more.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let final_rss = rss_kib(pid).unwrap_or(0);
    peak_rss = peak_rss.max(final_rss);
    let metrics = scrape(metrics_port).await;
    let reconciles = metrics
        .lines()
        .find(|l| l.starts_with("stoker_reconciles_total"))
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or("?")
        .to_string();
    let errors: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("stoker_reconcile_errors_total"))
        .collect();
    let mut times: Vec<f64> = ready.values().map(Duration::as_secs_f64).collect();
    times.sort_by(f64::total_cmp);

    println!("pipelines: {pipelines}, decoders per pipeline: {replicas}, pods: {pods}");
    println!(
        "pipelines Ready: {}/{pipelines}, all Ready after {:.1}s",
        ready.len(),
        all_ready.as_secs_f64()
    );
    println!(
        "apply→Ready per pipeline: p50 {:.2}s, p99 {:.2}s, max {:.2}s",
        quantile(&times, 0.5),
        quantile(&times, 0.99),
        times.last().copied().unwrap_or(f64::NAN)
    );
    println!(
        "reconcile duration (operator histogram): p50 {:.4}s, p99 {:.4}s over {reconciles} reconciles",
        histogram_quantile(&metrics, 0.5).unwrap_or(f64::NAN),
        histogram_quantile(&metrics, 0.99).unwrap_or(f64::NAN),
    );
    println!(
        "reconcile errors: {}",
        if errors.is_empty() {
            "none".to_string()
        } else {
            errors.join("; ")
        }
    );
    println!(
        "operator RSS: idle {:.1} MiB, peak {:.1} MiB, settled {:.1} MiB",
        idle_rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0,
        final_rss as f64 / 1024.0
    );
    println!(
        "decoder pods ever created: {} for {pods} asked for",
        decoders_ever.count()
    );
    watch.abort();
    drop(decoders_ever);
    drop(operator);

    // Steady state: a restarted operator reconciles every pipeline once with nothing to
    // change. Its own histogram holds only those reconciles.
    let pods_before = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .map(|l| l.items.len())
        .unwrap_or(0);
    let metrics_port = free_port();
    let restarted = start_operator(&cp, ns, metrics_port);
    let t1 = Instant::now();
    let mut last = (0.0, Instant::now());
    let settled = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let m = scrape(metrics_port).await;
        let n = counter(&m, "stoker_reconciles_total");
        if n != last.0 {
            last = (n, Instant::now());
        } else if n >= pipelines as f64 && last.1.elapsed() >= Duration::from_secs(5) {
            break m;
        }
        if t1.elapsed() > Duration::from_secs(600) {
            break m;
        }
    };
    let pods_after = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .map(|l| l.items.len())
        .unwrap_or(0);
    println!(
        "restarted operator (steady state): reconcile p50 {:.4}s, p99 {:.4}s over {} reconciles; children applied {}, unchanged {}; pods {pods_before} → {pods_after}",
        histogram_quantile(&settled, 0.5).unwrap_or(f64::NAN),
        histogram_quantile(&settled, 0.99).unwrap_or(f64::NAN),
        counter(&settled, "stoker_reconciles_total"),
        counter(&settled, "stoker_child_applies_total{result=\"applied\"}"),
        counter(&settled, "stoker_child_applies_total{result=\"unchanged\"}"),
    );
    drop(restarted);
    cp.stop();
}
