//! The story end to end, shortened: a synchronous trainer, then a DataPipeline whose autoscaler
//! spreads decoders over NIC-limited nodes, one decoder killed once two serve, a hundred whole
//! epochs. Every pod runs in runc as on a cluster: decoders and the sidecar from stoker's image
//! as 65532, the trainer as 1000, limits as cgroup limits, in a restricted namespace.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;
use stoker_demo::StoryOptions;
use stoker_testenv::prometheus::Prometheus;

/// Enough epochs for the trainer to outlast the scale-up and then run fed for half a minute.
const EPOCHS: u32 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_autoscaler_spreads_decoders_and_every_sample_arrives_once() {
    let world = common::World::start();
    let opts = StoryOptions {
        bucket: "story".into(),
        baseline: Duration::from_secs(10),
        recover_timeout: Duration::from_secs(240),
        epochs: EPOCHS,
        kill_decoder_after: Some(Duration::from_secs(25)),
        work_dir: world.out.clone(),
        ..StoryOptions::default()
    };
    let stage = world.stage();
    let report = stoker_demo::run(
        &stage,
        &opts,
        |t| eprintln!("{t:?}"),
        |d| eprintln!("{d:?}"),
    )
    .await
    .expect("the story runs");

    world.assert_every_sample_once(&report.keys_file, EPOCHS);
    // A killed decoder was replaced and lost nothing (the counts above).
    assert!(
        report.killed_decoder.is_some(),
        "a decoder was killed mid-story"
    );
    // The autoscaler scaled out over more than one node, and the trainer got busier.
    assert!(!report.decisions.is_empty(), "the autoscaler decided");
    assert!(
        report.decisions.iter().any(|d| d.to > d.from),
        "it scaled up: {:?}",
        report.decisions
    );
    assert!(
        report.decoder_nodes.len() > 1,
        "decoders on {:?}",
        report.decoder_nodes
    );
    let peak = report
        .ticks
        .iter()
        .filter(|t| t.phase == "pipeline")
        .map(|t| t.decoders)
        .max()
        .unwrap_or(0);
    assert!(peak > 1, "more than one decoder served");
    // GPU busy rises from a starved baseline (loading synchronously: the GPU waits most of
    // the time) to at least 85% (fed). The baseline's share follows how fast this machine
    // decodes in the trainer's own process (24-32% on a 2-core CI machine, 30.6% seen once):
    // "mostly waiting" is the claim, so the bound is below half, not a speed.
    let baseline_busy_pct = report.baseline_busy_pct.expect("the baseline ran");
    eprintln!(
        "GPU busy: {baseline_busy_pct:.1}% synchronous, {:.1}% fed",
        report.final_busy_pct
    );
    assert!(
        baseline_busy_pct < 50.0,
        "synchronous baseline at {baseline_busy_pct:.1}% busy"
    );
    assert!(
        report.final_busy_pct >= 85.0,
        "fed at only {:.1}% busy",
        report.final_busy_pct
    );
    // The sidecar ran in its own cgroup (runc, not a host process); the decoders fed the
    // trainer, so it used a small part of its CPU limit (sidecar_cpu.rs makes it decode alone).
    let sidecar: Vec<String> = report
        .ticks
        .iter()
        .filter(|t| t.phase == "pipeline")
        .map(|t| format!("{:.2}", t.sidecar_cpus))
        .collect();
    eprintln!(
        "sidecar CPUs per tick (limit {}): {}",
        report.sidecar_cpu_limit,
        sidecar.join(" ")
    );
    assert!(
        report.sidecar_cpus_peak > 0.0,
        "the sidecar's CPU time was read from its container's cgroup"
    );
    // No decoder node's NIC stayed above the 80% limit at the end.
    for (node, pct) in &report.final_nic_pct {
        assert!(*pct <= 90.0, "{node} NIC at {pct:.0}% at the end");
    }
    // Prometheus found the pods through the API server with the chart's PodMonitors: the series
    // the autoscaler read carry the PodMonitors' jobs and the labels their relabelings make.
    let decoders = job_node_container(
        &world.prometheus,
        r#"count by (job, node, container) (last_over_time(stoker_loader_samples_out_total{namespace="training",pipeline="demo",role="decoder"}[10m]))"#,
    )
    .await;
    let decoder_nodes: BTreeSet<String> = decoders
        .iter()
        .filter(|l| l.starts_with("stoker-system/stoker-decoders cpu-"))
        .map(|l| l.split(' ').nth(1).unwrap_or_default().to_string())
        .collect();
    assert!(
        decoder_nodes.is_superset(&report.decoder_nodes),
        "decoder series by job, node, container: {decoders:?}; decoders ended on {:?}",
        report.decoder_nodes
    );
    let sidecar = job_node_container(
        &world.prometheus,
        r#"count by (job, node, container) (last_over_time(stoker_sidecar_samples_delivered_total{namespace="training",pipeline="demo",role="trainer"}[10m]))"#,
    )
    .await;
    assert_eq!(
        sidecar,
        ["stoker-system/stoker-sidecars gpu-0 stoker-loader".to_string()].into(),
        "the sidecar's series by job, node, container"
    );
    world.runtime.shutdown();
}

/// `<job> <node> <container>` of each series `promql` returns.
async fn job_node_container(prometheus: &Prometheus, promql: &str) -> BTreeSet<String> {
    let result = prometheus.query(promql).await.expect("query");
    result
        .iter()
        .map(|r| {
            let m = &r["metric"];
            let label = |name: &str| m[name].as_str().unwrap_or_default().to_string();
            format!("{} {} {}", label("job"), label("node"), label("container"))
        })
        .collect()
}
