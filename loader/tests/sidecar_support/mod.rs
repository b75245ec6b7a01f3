//! Support for the sidecar tests: real `stoker-loader decode` and `stoker-loader sidecar`
//! processes, the in-process S3 server, and a trainer that records what it receives.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stoker_loader::sidecar::client::TrainerClient;
use stoker_loader::sidecar::protocol::{BatchHeader, Reply};
use stoker_testenv::http;
use stoker_testenv::s3::S3Server;

pub use stoker_testenv::metrics::metric;

pub const BUCKET: &str = "data";
pub const BIN: &str = env!("CARGO_BIN_EXE_stoker-loader");

/// A child process killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    pub line: String,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn field(&self, name: &str) -> String {
        self.line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name}= in {:?}", self.line))
            .to_string()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The S3 test server's credentials, no instance metadata, and none of the caller's own rank
/// or socket settings.
fn with_test_env(cmd: &mut Command, server: &S3Server) {
    cmd.env("AWS_ACCESS_KEY_ID", server.access_key())
        .env("AWS_SECRET_ACCESS_KEY", server.secret_key())
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("AWS_PROFILE")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("STOKER_SOCKET")
        .env_remove("STOKER_SHM_DIR")
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
}

fn spawn(mut cmd: Command, server: &S3Server) -> Proc {
    with_test_env(&mut cmd, server);
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn stoker-loader");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).expect("read listening line");
    assert!(
        line.contains("listening"),
        "process did not start: {line:?}"
    );
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = reader.read_to_end(&mut sink);
    });
    Proc { child, line }
}

fn s3_flags(cmd: &mut Command, server: &S3Server) {
    cmd.args([
        "--endpoint",
        &server.endpoint(),
        "--region",
        "us-east-1",
        "--force-path-style",
    ])
    .args(["--max-attempts", "4"]);
}

pub struct DecodeWorkerProc {
    pub proc: Proc,
    pub grpc: String,
    pub http: SocketAddr,
}

pub fn decode_worker(server: &S3Server) -> DecodeWorkerProc {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "decode",
        "--grpc-addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--threads",
        "1",
    ]);
    s3_flags(&mut cmd, server);
    let proc = spawn(cmd, server);
    let grpc = proc.field("grpc");
    let http = proc.field("http").parse().expect("http addr");
    DecodeWorkerProc { proc, grpc, http }
}

pub struct SidecarProc {
    pub proc: Proc,
    /// The first local rank's socket.
    pub socket: PathBuf,
    /// One per local rank served.
    pub sockets: Vec<PathBuf>,
    pub http: SocketAddr,
    pub shm: PathBuf,
}

impl SidecarProc {
    pub fn connect(&self) -> TrainerClient {
        TrainerClient::connect(&self.socket, Duration::from_secs(60)).expect("connect to sidecar")
    }

    pub fn metric(&self, series: &str) -> f64 {
        let text = http::blocking::get(self.http, "/metrics").expect("GET /metrics");
        metric(&text.1, series)
    }
}

/// Starts a sidecar over the `data` bucket; `extra` adds flags or replaces the defaults.
pub fn sidecar(
    server: &S3Server,
    dir: &Path,
    workers: &[&DecodeWorkerProc],
    extra: &[&str],
) -> SidecarProc {
    sidecar_with_env(server, dir, workers, extra, &[])
}

/// [`sidecar`] with extra environment variables (e.g. `KUBECONFIG`).
pub fn sidecar_with_env(
    server: &S3Server,
    dir: &Path,
    workers: &[&DecodeWorkerProc],
    extra: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> SidecarProc {
    let mut cmd = sidecar_command(server, dir, workers, extra);
    cmd.envs(env.iter().copied());
    let proc = spawn(cmd, server);
    let http = proc.field("http").parse().expect("http addr");
    let sockets: Vec<PathBuf> = proc.field("socket").split(',').map(PathBuf::from).collect();
    let shm_file = PathBuf::from(proc.field("shm").split(',').next().unwrap_or_default());
    SidecarProc {
        proc,
        socket: sockets[0].clone(),
        sockets,
        http,
        shm: shm_file,
    }
}

/// Runs a sidecar that must refuse to start; returns what it said on stderr.
pub fn sidecar_refusal(server: &S3Server, dir: &Path, extra: &[&str]) -> String {
    let mut cmd = sidecar_command(server, dir, &[], extra);
    with_test_env(&mut cmd, server);
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn stoker-loader");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the sidecar started instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success(), "the sidecar exited 0");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `stoker-loader sidecar` over the `data` bucket with its own shm dir; `extra` adds flags or
/// replaces the defaults.
fn sidecar_command(
    server: &S3Server,
    dir: &Path,
    workers: &[&DecodeWorkerProc],
    extra: &[&str],
) -> Command {
    let shm = dir.join(format!("shm-{}", fastrand_suffix()));
    std::fs::create_dir_all(&shm).expect("shm dir");
    let socket = shm.join("stoker.sock");
    let mut cmd = Command::new(BIN);
    cmd.args(["sidecar", "--bucket", BUCKET, "--http-addr", "127.0.0.1:0"])
        .arg("--shm-dir")
        .arg(&shm)
        .args(["--local-decoders", "1"]);
    if !extra.contains(&"--local-ranks") {
        cmd.arg("--socket").arg(&socket);
    }
    if !workers.is_empty() {
        let list: Vec<&str> = workers.iter().map(|w| w.grpc.as_str()).collect();
        cmd.arg("--workers").arg(list.join(","));
    }
    // Defaults for flags the test does not set: 64 x 48 crops, batches of 4.
    for (flag, value) in [("--batch-size", "4"), ("--width", "64"), ("--height", "48")] {
        if !extra.contains(&flag) {
            cmd.args([flag, value]);
        }
    }
    cmd.args(extra);
    s3_flags(&mut cmd, server);
    cmd
}

fn fastrand_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A JPEG test image; `seed` varies the content.
pub fn jpeg(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let mut rgb = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            rgb.extend_from_slice(&[
                ((x * 255) / w) as u8,
                ((y * 255) / h) as u8,
                ((seed * 37 + x + y) % 256) as u8,
            ]);
        }
    }
    let img = turbojpeg::Image {
        pixels: rgb.as_slice(),
        width: w as usize,
        pitch: w as usize * 3,
        height: h as usize,
        format: turbojpeg::PixelFormat::RGB,
    };
    turbojpeg::compress(img, 90, turbojpeg::Subsamp::Sub2x2)
        .expect("jpeg encode")
        .to_vec()
}

/// `n` JPEGs named img-0000.jpg... in the bucket; returns their keys.
pub fn dataset(server: &S3Server, n: usize, w: u32, h: u32) -> Vec<String> {
    (0..n)
        .map(|i| {
            let key = format!("img-{i:04}.jpg");
            server
                .put_object(BUCKET, &key, &jpeg(w, h, i as u32))
                .expect("put");
            key
        })
        .collect()
}

/// What a trainer saw in one epoch.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Epoch {
    pub epoch: u64,
    pub batches: Vec<Vec<String>>,
    pub skips: Vec<(String, String)>,
}

impl Epoch {
    pub fn keys(&self) -> Vec<String> {
        self.batches.iter().flatten().cloned().collect()
    }
}

/// Consumes one epoch, checking every delivered sample's pixels have the announced shape;
/// `on_batch(i)` runs after batch i was received (used to inject faults and pauses).
pub fn consume_epoch(
    client: &mut TrainerClient,
    mut on_batch: impl FnMut(usize, &BatchHeader),
) -> Epoch {
    let mut out = Epoch::default();
    loop {
        match client.next(Duration::from_secs(60)).expect("next") {
            Reply::Batch(b) => {
                let mut keys = Vec::new();
                for (i, s) in b.samples.iter().enumerate() {
                    keys.push(s.key.clone());
                    match &s.skip {
                        Some(reason) => out.skips.push((s.key.clone(), reason.clone())),
                        None => {
                            let px = client.pixels(&b, i);
                            assert_eq!(px.len(), (s.shape[0] * s.shape[1] * 3) as usize);
                            assert!(px.iter().any(|&v| v != 0), "{} is all zeros", s.key);
                        }
                    }
                }
                out.epoch = b.epoch;
                on_batch(out.batches.len(), &b);
                out.batches.push(keys);
                client.release(b.slot).expect("release");
            }
            Reply::EndOfEpoch { epoch } => {
                out.epoch = epoch;
                return out;
            }
            other => panic!("unexpected reply {other:?}"),
        }
    }
}

/// VmRSS of a process in KiB.
pub fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
