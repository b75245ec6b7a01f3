//! Shared test support: image fixtures, the S3 server, an in-process decode worker.

#![allow(dead_code)]

use std::sync::Arc;

use stoker_loader::metrics::LoaderMetrics;
use stoker_loader::proto;
use stoker_loader::source::{RetryPolicy, S3Config, S3Source, StaticCredentials};
use stoker_loader::worker::{DecodeClient, DecodeServer, WorkerConfig, WorkerState};
use stoker_testenv::s3::S3Server;

#[allow(unused_imports)] // not every test binary reads metrics
pub use stoker_testenv::metrics::metric;

pub const BUCKET: &str = "data";

/// A smooth, asymmetric RGB test pattern: gradients plus a bright block in the top-left
/// quadrant, so orientation and cropping mistakes show up as large pixel differences.
pub fn pattern(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let block = x < w / 4 && y < h / 4;
            let r = if block {
                250
            } else {
                (x * 200 / w.max(1)) as u8
            };
            let g = (y * 200 / h.max(1)) as u8;
            let b = (((x + y) * 255) / (w + h)) as u8;
            out.extend_from_slice(&[r, g, b]);
        }
    }
    out
}

pub fn jpeg(w: u32, h: u32) -> Vec<u8> {
    jpeg_of(&pattern(w, h), w, h)
}

pub fn jpeg_of(rgb: &[u8], w: u32, h: u32) -> Vec<u8> {
    let img = turbojpeg::Image {
        pixels: rgb,
        width: w as usize,
        pitch: w as usize * 3,
        height: h as usize,
        format: turbojpeg::PixelFormat::RGB,
    };
    turbojpeg::compress(img, 92, turbojpeg::Subsamp::Sub2x2)
        .expect("jpeg encode")
        .to_vec()
}

pub fn png(w: u32, h: u32) -> Vec<u8> {
    use image::ImageEncoder;
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&pattern(w, h), w, h, image::ExtendedColorType::Rgb8)
        .expect("png encode");
    out
}

pub fn png_rgba(w: u32, h: u32, alpha: u8) -> Vec<u8> {
    use image::ImageEncoder;
    let rgb = pattern(w, h);
    let rgba: Vec<u8> = rgb
        .chunks(3)
        .flat_map(|p| [p[0], p[1], p[2], alpha])
        .collect();
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&rgba, w, h, image::ExtendedColorType::Rgba8)
        .expect("png encode");
    out
}

pub fn webp(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::webp::WebPEncoder::new_lossless(&mut out)
        .encode(&pattern(w, h), w, h, image::ExtendedColorType::Rgb8)
        .expect("webp encode");
    out
}

pub fn s3_config(server: &S3Server) -> S3Config {
    S3Config {
        endpoint: Some(server.endpoint()),
        region: Some("us-east-1".into()),
        force_path_style: true,
        credentials: Some(StaticCredentials {
            access_key_id: server.access_key().into(),
            secret_access_key: server.secret_key().into(),
        }),
        retry: RetryPolicy {
            max_attempts: 12,
            base: std::time::Duration::from_millis(5),
            cap: std::time::Duration::from_millis(200),
            jitter: true,
        },
        ..S3Config::default()
    }
}

pub async fn source(server: &S3Server) -> (S3Source, Arc<LoaderMetrics>) {
    let metrics = Arc::new(LoaderMetrics::new());
    (
        S3Source::connect(&s3_config(server), metrics.clone()).await,
        metrics,
    )
}

/// An in-process worker on loopback ports; dropped with the test's runtime.
pub struct TestWorker {
    pub client: DecodeClient,
    pub state: Arc<WorkerState>,
    pub http: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestWorker {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

pub async fn worker(server: Option<&S3Server>, threads: usize) -> TestWorker {
    worker_with_queue(server, threads, 0).await
}

/// A worker admitting at most `queue_depth` batches (0: the default).
pub async fn worker_with_queue(
    server: Option<&S3Server>,
    threads: usize,
    queue_depth: usize,
) -> TestWorker {
    let config = WorkerConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        threads,
        queue_depth,
        s3: server.map(s3_config),
        ..WorkerConfig::default()
    };
    let srv = DecodeServer::bind(config).await.expect("bind");
    let grpc = srv.grpc_addr().unwrap();
    let http = srv.http_addr().unwrap();
    let state = srv.state.clone();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = srv
            .serve(async {
                let _ = stop_rx.await;
            })
            .await;
    });
    let client = DecodeClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    TestWorker {
        client,
        state,
        http,
        stop: Some(stop),
    }
}

pub fn request(keys: &[&str], transform: proto::Transform) -> proto::DecodeBatchRequest {
    proto::DecodeBatchRequest {
        batch_id: 1,
        bucket: BUCKET.into(),
        samples: keys
            .iter()
            .map(|k| proto::SampleRef {
                key: (*k).into(),
                ..Default::default()
            })
            .collect(),
        transform: Some(transform),
    }
}

pub fn crop(w: u32, h: u32) -> proto::Transform {
    proto::Transform {
        resize: "crop".into(),
        width: w,
        height: h,
        ..Default::default()
    }
}

/// Mean absolute difference of two equally sized buffers.
pub fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sum: u64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| u64::from(x.abs_diff(*y)))
        .sum();
    sum as f64 / a.len() as f64
}

/// GETs the worker's /metrics.
pub async fn metrics_text(w: &TestWorker) -> String {
    stoker_testenv::http::get(w.http, "/metrics")
        .await
        .expect("GET /metrics")
        .1
}

/// A `stoker-loader decode` process reading `server`, with `extra` flags, and the addresses it
/// announces on its first stdout line. Killed when dropped.
pub struct DecoderProcess {
    pub child: std::process::Child,
    pub grpc: std::net::SocketAddr,
    pub http: std::net::SocketAddr,
}

impl Drop for DecoderProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn spawn_decoder(server: &S3Server, extra: &[&str]) -> DecoderProcess {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_stoker-loader"))
        .args([
            "decode",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--force-path-style",
            "--endpoint",
            &server.endpoint(),
            "--region",
            "us-east-1",
        ])
        .args(extra)
        .env("AWS_ACCESS_KEY_ID", server.access_key())
        .env("AWS_SECRET_ACCESS_KEY", server.secret_key())
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
        )
        .env_remove("AWS_PROFILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("stoker-loader decode starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the decoder's first line");
    let addr = |name: &str| -> std::net::SocketAddr {
        line.split(&format!("{name}="))
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no {name} address in {line:?}"))
    };
    DecoderProcess {
        grpc: addr("grpc"),
        http: addr("http"),
        child,
    }
}

/// The test venv's python (scripts/python-env.sh installs webdataset and pyarrow there):
/// `$STOKER_PYTHON`, as scripts/test.sh sets it, else the script's answer (which installs what
/// is missing: tests running at once must not each reinstall, so CI sets the variable).
pub fn python() -> std::path::PathBuf {
    if let Some(python) = std::env::var_os("STOKER_PYTHON") {
        return python.into();
    }
    let script = stoker_testenv::manifest_dir().join("../scripts/python-env.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .output()
        .expect("python-env.sh");
    assert!(
        out.status.success(),
        "python-env.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let venv = String::from_utf8(out.stdout).unwrap();
    std::path::Path::new(venv.trim()).join("bin/python")
}

/// The `stoker-loader` binary with `args`, pointed at `server` with its credentials.
pub fn loader_command(server: &S3Server, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_stoker-loader"));
    cmd.args(args)
        .args(["--endpoint", &server.endpoint(), "--region", "us-east-1"])
        .arg("--force-path-style")
        .env("AWS_ACCESS_KEY_ID", server.access_key())
        .env("AWS_SECRET_ACCESS_KEY", server.secret_key())
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("AWS_PROFILE");
    cmd
}

/// Writes a dataset under `prefix` of the data bucket with the test venv's python running
/// `script` with the directory, `files` and `per` as arguments (the `webdataset` and `pyarrow`
/// writers).
pub fn write_with_python(server: &S3Server, script: &str, prefix: &str, files: usize, per: usize) {
    let dir = server.root().join(BUCKET).join(prefix);
    std::fs::create_dir_all(&dir).unwrap();
    let out = std::process::Command::new(python())
        .args(["-c", script])
        .arg(&dir)
        .args([files.to_string(), per.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "writing the dataset: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Rank `rank` of `world`'s shuffled plan, batches of `batch`, seed 7.
pub fn shard_plan(rank: u32, world: u32, batch: usize) -> stoker_loader::sidecar::plan::PlanConfig {
    use stoker_loader::sidecar::plan::{PlanConfig, Shard};
    PlanConfig {
        seed: 7,
        batch_size: batch,
        drop_last: false,
        shuffle: true,
        shard: Shard {
            rank,
            world_size: world,
        },
    }
}

/// Runs `stoker-loader index` as its own process; returns its JSON summary line.
pub fn index_process(server: &S3Server, args: &[&str]) -> serde_json::Value {
    let mut full = vec!["index"];
    full.extend_from_slice(args);
    let out = loader_command(server, &full).output().unwrap();
    assert!(
        out.status.success(),
        "index failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What the build left out, with its reasons (shown with --nocapture).
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

/// One decoded or skipped sample as the trainer sees it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub shard_key: String,
    pub metadata: serde_json::Value,
    pub skip: String,
    pub width: u32,
    /// The stored image's width: which image a row's bytes were.
    pub orig_width: u32,
}

pub async fn decode_shard_samples(
    worker: &mut TestWorker,
    table: &stoker_loader::index::ShardTable,
    source: &S3Source,
    samples: &[stoker_loader::sidecar::plan::ShardSample],
) -> Vec<Delivered> {
    let refs = table.sample_refs(source, samples).await.unwrap();
    let reply = worker
        .client
        .decode_batch(proto::DecodeBatchRequest {
            batch_id: 1,
            bucket: table.bucket.clone(),
            samples: refs.iter().map(proto::SampleRef::from).collect(),
            transform: Some(crop(16, 16)),
        })
        .await
        .unwrap();
    reply
        .samples
        .into_iter()
        .map(|m| Delivered {
            shard_key: m.key,
            metadata: serde_json::from_str(&m.metadata).unwrap(),
            skip: m.skip_reason,
            width: m.width,
            orig_width: m.orig_width,
        })
        .collect()
}

/// GET requests the worker has sent.
pub fn get_requests(worker: &TestWorker) -> f64 {
    metric(
        &worker.state.metrics.encode(),
        "stoker_loader_s3_requests_total{op=\"get_object\"}",
    )
}
