//! The world the demo tests run in: the shared control plane, a node runtime (every pod in
//! runc, the trainer from [`stoker_demo::trainer_image`]), the S3 server holding a small set of
//! real photographs, and Prometheus finding the pods through the API server with the chart's
//! PodMonitors.
// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use stoker_demo::Stage;
use stoker_testenv::cluster::ControlPlane;
use stoker_testenv::prometheus::Prometheus;
use stoker_testenv::runtime::{NodeRuntime, RuntimeOptions};
use stoker_testenv::s3::S3ServerConfig;

pub const IMAGES: usize = 96;
/// The story's batch size (StoryOptions' default).
pub const BATCH: usize = 16;

pub struct World {
    pub runtime: NodeRuntime,
    pub s3: stoker_testenv::s3::S3Server,
    pub prometheus: Prometheus,
    /// The bucket's keys.
    pub keys: Vec<String>,
    /// Where the trainer writes its reports (writable in its container).
    pub out: PathBuf,
    _work: tempfile::TempDir,
}

impl World {
    /// Call from a multi-threaded tokio test.
    pub fn start() -> World {
        Self::start_with(RuntimeOptions::default())
    }

    /// [`World::start`] with the runtime's stoker image options from `base` (the rest are
    /// the world's).
    pub fn start_with(base: RuntimeOptions) -> World {
        let python = std::env::var("STOKER_PYTHON")
            .expect("STOKER_PYTHON: the venv python from scripts/python-env.sh");
        let work = tempfile::tempdir().expect("tempdir");
        let keys = dataset(work.path());
        let out = work.path().join("out");
        let trainer = stoker_demo::trainer_image(
            stoker_demo::TRAINER_IMAGE,
            python.as_ref(),
            &repo().join("demo/trainer.py"),
            &out,
        )
        .expect("the trainer's image");
        let cp = ControlPlane::shared();
        let nic_mbit =
            stoker_demo::nic_mbit(cp, stoker_demo::CPU_NIC_MBIT, stoker_demo::GPU_NIC_MBIT);
        let runtime = tokio::task::block_in_place(|| {
            NodeRuntime::start(
                cp,
                RuntimeOptions {
                    images: vec![trainer],
                    nic_mbit,
                    ..base
                },
            )
        })
        .expect("node runtime");
        let s3 = runtime
            .start_s3(S3ServerConfig::new(work.path()))
            .expect("s3");
        let prometheus = tokio::task::block_in_place(|| {
            stoker_demo::start_prometheus(cp, &runtime, &repo().join("charts/stoker"))
        })
        .expect("prometheus");
        World {
            runtime,
            s3,
            prometheus,
            keys,
            out,
            _work: work,
        }
    }

    pub fn stage(&self) -> Stage<'_> {
        Stage {
            cluster: ControlPlane::shared(),
            runtime: &self.runtime,
            prometheus: &self.prometheus,
            s3: &self.s3,
        }
    }

    /// Every sample of each of `epochs` epochs reached the trainer exactly once (dropLast: whole
    /// batches), by the trainer's `<epoch> <key>` lines.
    pub fn assert_every_sample_once(&self, keys_file: &Path, epochs: u32) {
        let delivered = std::fs::read_to_string(keys_file).expect("keys file");
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
            epochs as usize,
            "all epochs ran: {:?}",
            per_epoch.keys()
        );
        let whole = self.keys.len() / BATCH * BATCH;
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
                got.iter().all(|k| self.keys.contains(k)),
                "epoch {epoch}: unknown key"
            );
        }
    }
}

pub fn repo() -> PathBuf {
    stoker_testenv::manifest_dir().join("..")
}

/// A small set of real photographs (scikit-image's samples, re-cut by bench/make_dataset.py),
/// served as bucket `story`; returns its keys.
pub fn dataset(root: &std::path::Path) -> Vec<String> {
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
