//! The story end to end, shortened: a synchronous trainer, then a DataPipeline whose autoscaler
//! spreads decoders over NIC-limited nodes, one decoder killed once two serve, a hundred whole
//! epochs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use stoker_demo::{Stage, StoryOptions};
use stoker_testenv::cluster::ControlPlane;
use stoker_testenv::prometheus::{Prometheus, PrometheusOptions};
use stoker_testenv::runtime::{ImageMapping, NodeRuntime, RuntimeOptions};
use stoker_testenv::s3::S3ServerConfig;

const IMAGES: usize = 96;
const BATCH: usize = 16;
/// Enough epochs for the trainer to outlast the scale-up and then run fed for half a minute.
const EPOCHS: u32 = 100;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A small set of real photographs (scikit-image's samples, re-cut by bench/make_dataset.py),
/// served as bucket `story`; returns its keys.
fn dataset(root: &std::path::Path) -> Vec<String> {
    let bucket = root.join("story");
    std::fs::create_dir_all(&bucket).expect("bucket dir");
    let python = std::env::var("STOKER_PYTHON").unwrap_or_else(|_| "python3".into());
    let status = std::process::Command::new(python)
        .arg(repo().join("bench/make_dataset.py"))
        .args([
            "--root",
            &root.display().to_string(),
            "--set",
            "mixed",
            "--count",
            &IMAGES.to_string(),
        ])
        .status()
        .expect("run bench/make_dataset.py");
    assert!(status.success(), "dataset generation failed");
    std::fs::remove_dir_all(&bucket).ok();
    std::fs::rename(root.join("mixed"), &bucket).expect("rename bucket");
    let mut keys: Vec<String> = std::fs::read_dir(&bucket)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_autoscaler_spreads_decoders_and_every_sample_arrives_once() {
    let python = std::env::var("STOKER_PYTHON")
        .expect("STOKER_PYTHON: the venv python from scripts/python-env.sh");
    let work = tempfile::tempdir().expect("tempdir");
    let keys = dataset(work.path());
    let cp = ControlPlane::shared();
    let nic_mbit = stoker_demo::nic_mbit(cp, stoker_demo::CPU_NIC_MBIT, stoker_demo::GPU_NIC_MBIT);
    let runtime = tokio::task::block_in_place(|| {
        NodeRuntime::start(
            cp,
            RuntimeOptions {
                images: vec![ImageMapping::new(
                    "*stoker-sim-trainer*",
                    [
                        python.clone(),
                        repo().join("demo/trainer.py").display().to_string(),
                    ],
                )],
                nic_mbit,
                ..RuntimeOptions::default()
            },
        )
    })
    .expect("node runtime");
    let s3 = runtime
        .start_s3(S3ServerConfig::new(work.path()))
        .expect("s3");
    let prometheus = tokio::task::block_in_place(|| {
        Prometheus::start(PrometheusOptions {
            scrape_interval: Duration::from_secs(2),
            ..PrometheusOptions::new(runtime.sd_dir())
        })
    })
    .expect("prometheus");
    let opts = StoryOptions {
        bucket: "story".into(),
        baseline: Duration::from_secs(10),
        recover_timeout: Duration::from_secs(240),
        epochs: EPOCHS,
        kill_decoder_after: Some(Duration::from_secs(25)),
        work_dir: work.path().join("out"),
        ..StoryOptions::default()
    };
    let stage = Stage {
        cluster: cp,
        runtime: &runtime,
        prometheus: &prometheus,
        s3: &s3,
    };
    let report = stoker_demo::run(
        &stage,
        &opts,
        |t| eprintln!("{t:?}"),
        |d| eprintln!("{d:?}"),
    )
    .await
    .expect("the story runs");

    // Every sample of every epoch reached the trainer exactly once (dropLast: whole batches).
    let delivered = std::fs::read_to_string(&report.keys_file).expect("keys file");
    let mut per_epoch: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for line in delivered.lines() {
        let (epoch, key) = line.split_once(' ').expect("<epoch> <key>");
        assert!(
            !key.contains("skip:"),
            "no sample of this dataset is bad: {line}"
        );
        per_epoch
            .entry(epoch.parse().expect("epoch"))
            .or_default()
            .push(key.to_string());
    }
    assert_eq!(
        per_epoch.len(),
        EPOCHS as usize,
        "all epochs ran: {:?}",
        per_epoch.keys()
    );
    let whole = keys.len() / BATCH * BATCH;
    for (epoch, mut got) in per_epoch {
        assert_eq!(
            got.len(),
            whole,
            "epoch {epoch}: {} samples, want {whole}",
            got.len()
        );
        got.sort();
        got.dedup();
        assert_eq!(got.len(), whole, "epoch {epoch}: a sample arrived twice");
        assert!(
            got.iter().all(|k| keys.contains(k)),
            "epoch {epoch}: unknown key"
        );
    }
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
    // GPU busy rises from below 30% (loading synchronously) to at least 85% (fed).
    eprintln!(
        "GPU busy: {:.1}% synchronous, {:.1}% fed",
        report.baseline_busy_pct, report.final_busy_pct
    );
    assert!(
        report.baseline_busy_pct < 30.0,
        "synchronous baseline at {:.1}% busy",
        report.baseline_busy_pct
    );
    assert!(
        report.final_busy_pct >= 85.0,
        "fed at only {:.1}% busy",
        report.final_busy_pct
    );
    // No decoder node's NIC stayed above the 80% limit at the end.
    for (node, pct) in &report.final_nic_pct {
        assert!(*pct <= 90.0, "{node} NIC at {pct:.0}% at the end");
    }
    runtime.shutdown();
}
