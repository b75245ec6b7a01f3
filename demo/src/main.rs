//! `stoker-demo`: the story on one machine, told as it unfolds (see the library's docs).
//! `scripts/demo.sh` builds everything, generates the dataset and runs this.

use anyhow::{Context, Result};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use stoker_demo::{Decision, StoryOptions, StoryReport, Tick};
use stoker_testenv::cluster::{ControlPlane, Options};
use stoker_testenv::runtime::{NodeRuntime, RuntimeOptions};
use stoker_testenv::s3::S3ServerConfig;

#[derive(Parser)]
#[command(about = "A starved trainer, a DataPipeline, and the autoscaler feeding it")]
struct Cli {
    /// Directory holding one folder per bucket (the dataset the S3 server serves).
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value = "demo")]
    bucket: String,
    /// Python with numpy, boto3, pillow and the `stoker` client (scripts/python-env.sh).
    #[arg(long)]
    python: PathBuf,
    /// The simulated trainer.
    #[arg(long, default_value = "demo/trainer.py")]
    trainer: PathBuf,
    /// Python with torch, boto3 and pillow (bench/setup.sh): adds the phase most trainers try
    /// after the synchronous loop, a PyTorch DataLoader with workers on the GPU node.
    #[arg(long)]
    torch_python: Option<PathBuf>,
    /// The DataLoader's worker processes (through S3 on 2 cores, 4 beat 2 in bench-decode.sh).
    #[arg(long, default_value_t = 4)]
    dataloader_workers: u32,
    /// The Helm chart whose PodMonitors Prometheus discovers the pods with.
    #[arg(long, default_value = "charts/stoker")]
    chart: PathBuf,
    /// The stoker-loader binary the decoder and sidecar containers run.
    #[arg(long)]
    loader: PathBuf,
    /// Where the timeline, the plot and the logs go.
    #[arg(long, default_value = "demo-out")]
    out: PathBuf,
    /// Each CPU node's NIC, in Mbit/s (the simulated 25 Gb/s scaled to this machine).
    #[arg(long, default_value_t = stoker_demo::CPU_NIC_MBIT)]
    cpu_nic_mbit: u32,
    /// Each GPU node's NIC, in Mbit/s.
    #[arg(long, default_value_t = stoker_demo::GPU_NIC_MBIT)]
    gpu_nic_mbit: u32,
    #[arg(long, default_value_t = 20)]
    baseline_secs: u64,
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    std::fs::create_dir_all(&cli.out)?;
    let out = std::fs::canonicalize(&cli.out)?;
    let trainer = std::fs::canonicalize(&cli.trainer).context("the simulated trainer script")?;

    println!("starting: control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK)");
    let cluster_dir = out.join("cluster");
    let _ = std::fs::remove_dir_all(&cluster_dir);
    let cluster = tokio::task::block_in_place(|| {
        ControlPlane::start(Options {
            dir: Some(cluster_dir),
            ..Default::default()
        })
    })?;
    let nic_mbit = stoker_demo::nic_mbit(&cluster, cli.cpu_nic_mbit, cli.gpu_nic_mbit);
    println!(
        "starting: node runtime (a network namespace per node, NICs limited with tc: CPU nodes {} Mbit/s, GPU nodes {} Mbit/s)",
        cli.cpu_nic_mbit, cli.gpu_nic_mbit
    );
    let mut images = vec![stoker_demo::trainer_image(
        stoker_demo::TRAINER_IMAGE,
        &cli.python,
        &trainer,
        &out,
    )?];
    if let Some(torch) = &cli.torch_python {
        images.push(stoker_demo::trainer_image(
            stoker_demo::TORCH_TRAINER_IMAGE,
            torch,
            &trainer,
            &out,
        )?);
    }
    let runtime = tokio::task::block_in_place(|| {
        NodeRuntime::start(
            &cluster,
            RuntimeOptions {
                loader_bin: cli.loader.clone(),
                images,
                nic_mbit,
                dir: Some(out.join("runtime")),
                ..RuntimeOptions::default()
            },
        )
    })?;
    let s3 = runtime.start_s3(S3ServerConfig::new(&cli.data))?;
    println!(
        "starting: S3 at {} (bucket {}), Prometheus, the operator",
        s3.endpoint(),
        cli.bucket
    );
    let prometheus = tokio::task::block_in_place(|| {
        stoker_demo::start_prometheus(&cluster, &runtime, &cli.chart)
    })?;

    let opts = StoryOptions {
        bucket: cli.bucket.clone(),
        baseline: Duration::from_secs(cli.baseline_secs),
        recover_timeout: Duration::from_secs(cli.timeout_secs),
        work_dir: out.clone(),
        dataloader_workers: cli.torch_python.is_some().then_some(cli.dataloader_workers),
        ..StoryOptions::default()
    };
    let stage = stoker_demo::Stage {
        cluster: &cluster,
        runtime: &runtime,
        prometheus: &prometheus,
        s3: &s3,
    };
    println!(
        "\n{:>6}  {:<9} {:>6} {:>10} {:>9} {:>6}  {:>16} {:>12}",
        "t(s)", "phase", "busy%", "data wait%", "decoders", "nodes", "busiest NIC", "sidecar CPU"
    );
    let story = tokio::select! {
        r = stoker_demo::run(&stage, &opts, print_tick, print_decision) => r,
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted: stopping everything");
            runtime.shutdown();
            return Ok(());
        }
    };
    let report = story?;
    summarize(&report);
    std::fs::write(
        out.join("timeline.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let plot = out.join("story.png");
    let status = std::process::Command::new(&cli.python)
        .arg(trainer.with_file_name("plot.py"))
        .arg(out.join("timeline.json"))
        .arg(&plot)
        .status()?;
    if status.success() {
        println!("plot: {}", plot.display());
    }
    runtime.shutdown();
    Ok(())
}

fn print_tick(t: &Tick) {
    println!(
        "{:>6.0}  {:<9} {:>6.1} {:>10.1} {:>9} {:>6}  {:>6.0}% {:<8} {:>12.2}",
        t.t,
        t.phase,
        t.busy_pct,
        t.wait_pct,
        t.decoders,
        t.nodes,
        t.busiest_nic_pct,
        t.busiest_nic_node,
        t.sidecar_cpus
    );
}

fn print_decision(d: &Decision) {
    println!(
        "        autoscaler: {} → {} decoders: {}",
        d.from, d.to, d.reason
    );
}

fn summarize(r: &StoryReport) {
    println!("\n== summary");
    if let Some(busy) = r.baseline_busy_pct {
        println!("  GPU busy, trainer loading synchronously: {busy:>5.1}%");
    }
    if let Some(busy) = r.dataloader_busy_pct {
        println!("  GPU busy, PyTorch DataLoader:            {busy:>5.1}%");
    }
    println!(
        "  GPU busy, fed by stoker (end):           {:>5.1}%",
        r.final_busy_pct
    );
    match r.recovered_after_s {
        Some(s) => println!("  time from DataPipeline to fed:           {s:>5.0} s"),
        None => println!("  the trainer was not fed within the timeout"),
    }
    println!(
        "  sidecar CPU, most over one tick:         {:>5.2} of its limit {}",
        r.sidecar_cpus_peak, r.sidecar_cpu_limit
    );
    println!(
        "  decoders at the end: on {} node(s): {:?}",
        r.decoder_nodes.len(),
        r.decoder_nodes
    );
    let nic: Vec<String> = r
        .final_nic_pct
        .iter()
        .filter(|(_, p)| **p >= 1.0)
        .map(|(n, p)| format!("{n} {p:.0}%"))
        .collect();
    println!("  CPU-node NIC use at the end: {}", nic.join(", "));
    println!("  autoscaler decisions: {}", r.decisions.len());
    for d in &r.decisions {
        println!("    t={:>4.0}s {} → {}: {}", d.t, d.from, d.to, d.reason);
    }
}
