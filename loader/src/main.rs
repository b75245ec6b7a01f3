//! `stoker-loader`: `decode` (the gRPC decode worker), `profile` (timing breakdown on a sample
//! of a dataset) and `bench` (drives decode workers with real batches and reports images/s).

mod bench;

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use stoker_loader::decode::DecodeLimits;
use stoker_loader::profile::{ProfileConfig, run_profile};
use stoker_loader::source::{S3Config, S3Source};
use stoker_loader::transform::Transform;
use stoker_loader::worker::{DecodeServer, WorkerConfig};

#[derive(Parser)]
#[command(name = "stoker-loader", version, about = "stoker's data plane")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve DecodeBatch over gRPC, with /metrics, /healthz and /readyz over HTTP.
    Decode(DecodeArgs),
    /// Time list, GET, decode, resize and pack on a sample of a dataset.
    Profile(ProfileArgs),
    /// Send a dataset through decode workers as batches and report images/s.
    Bench(bench::BenchArgs),
    /// Next to the trainer: epoch order, prefetch across decode workers, shared-memory hand-off.
    Sidecar(Box<SidecarCmd>),
}

#[derive(Args, Debug)]
struct SidecarCmd {
    #[command(flatten)]
    sidecar: stoker_loader::sidecar::SidecarArgs,
    #[command(flatten)]
    transform: TransformArgs,
    #[command(flatten)]
    s3: S3Args,
}

/// Where objects live. Credentials come from the standard AWS chain (environment variables,
/// profile, web identity, instance metadata), never from flags, and are never logged.
#[derive(Args, Clone, Debug)]
pub struct S3Args {
    /// S3-compatible endpoint, e.g. http://minio.storage:9000.
    #[arg(long, env = "STOKER_S3_ENDPOINT")]
    pub endpoint: Option<String>,
    #[arg(long, env = "STOKER_S3_REGION")]
    pub region: Option<String>,
    /// Path-style addressing (most S3-compatible stores need it).
    #[arg(long, env = "STOKER_S3_FORCE_PATH_STYLE")]
    pub force_path_style: bool,
    /// S3 GETs in flight at once.
    #[arg(long, default_value_t = 64)]
    pub max_concurrent_gets: usize,
    /// Attempts per request before a sample is skipped as s3_error.
    #[arg(long, default_value_t = 10)]
    pub max_attempts: u32,
}

impl S3Args {
    pub fn config(&self) -> S3Config {
        let mut c = S3Config {
            endpoint: self.endpoint.clone(),
            region: self.region.clone(),
            force_path_style: self.force_path_style,
            max_concurrent_gets: self.max_concurrent_gets,
            ..S3Config::default()
        };
        c.retry.max_attempts = self.max_attempts.max(1);
        c
    }
}

#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum ResizeMode {
    Crop,
    Fit,
    QwenSmart,
}

#[derive(Args, Clone, Debug)]
pub struct TransformArgs {
    #[arg(long, value_enum, default_value = "crop")]
    pub resize: ResizeMode,
    #[arg(long, default_value_t = 448)]
    pub width: u32,
    #[arg(long, default_value_t = 448)]
    pub height: u32,
    /// Padding gray level for `fit`.
    #[arg(long, default_value_t = 0)]
    pub pad: u8,
    /// qwenSmart: sides are multiples of this (patch size x merge size).
    #[arg(long, default_value_t = 28)]
    pub factor: u32,
    #[arg(long, default_value_t = 4 * 28 * 28)]
    pub min_pixels: u64,
    #[arg(long, default_value_t = 16384 * 28 * 28)]
    pub max_pixels: u64,
}

impl TransformArgs {
    pub fn transform(&self) -> anyhow::Result<Transform> {
        let t = match self.resize {
            ResizeMode::Crop => Transform::Crop {
                width: self.width,
                height: self.height,
            },
            ResizeMode::Fit => Transform::Fit {
                width: self.width,
                height: self.height,
                pad: self.pad,
            },
            ResizeMode::QwenSmart => Transform::QwenSmart {
                factor: self.factor,
                min_pixels: self.min_pixels,
                max_pixels: self.max_pixels,
            },
        };
        t.validate()?;
        Ok(t)
    }
}

#[derive(Args, Debug)]
struct DecodeArgs {
    #[arg(long, env = "STOKER_GRPC_ADDR", default_value = "0.0.0.0:50051")]
    grpc_addr: SocketAddr,
    #[arg(long, env = "STOKER_HTTP_ADDR", default_value = "0.0.0.0:9090")]
    http_addr: SocketAddr,
    /// Decode threads; 0 = one per core.
    #[arg(long, env = "STOKER_DECODE_THREADS", default_value_t = 0)]
    threads: usize,
    /// Batches admitted at once; further requests get RESOURCE_EXHAUSTED. 0 = 2 x threads + 2.
    #[arg(long, default_value_t = 0)]
    queue_depth: usize,
    /// Largest width x height read from a header before a sample is skipped as too_large.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    max_pixels: u64,
    /// Seconds to wait for in-flight batches after SIGTERM.
    #[arg(long, default_value_t = 60)]
    drain_timeout_secs: u64,
    #[command(flatten)]
    s3: S3Args,
}

#[derive(Args, Debug)]
struct ProfileArgs {
    #[arg(long)]
    bucket: String,
    #[arg(long, default_value = "")]
    prefix: String,
    /// JSONL manifest, s3://bucket/key or a local path, instead of listing.
    #[arg(long)]
    manifest: Option<String>,
    /// Objects to sample.
    #[arg(long, default_value_t = 200)]
    sample: usize,
    /// Target images/s for the "cores needed" row.
    #[arg(long, default_value_t = 1000.0)]
    target_rate: f64,
    /// GETs in flight while sampling.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    transform: TransformArgs,
    #[command(flatten)]
    s3: S3Args,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.command {
            Command::Decode(args) => decode(args).await,
            Command::Profile(args) => profile(args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Sidecar(args) => sidecar(args).await,
        }
    })
}

async fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let config = WorkerConfig {
        grpc_addr: args.grpc_addr,
        http_addr: args.http_addr,
        threads: args.threads,
        queue_depth: args.queue_depth,
        limits: DecodeLimits {
            max_pixels: args.max_pixels,
        },
        s3: Some(args.s3.config()),
        drain_timeout: Duration::from_secs(args.drain_timeout_secs),
        ..WorkerConfig::default()
    };
    let server = DecodeServer::bind(config).await?;
    // Scripts and tests wait for this line to learn the ports.
    println!(
        "stoker-loader decode listening grpc={} http={}",
        server.grpc_addr()?,
        server.http_addr()?
    );
    server.serve(shutdown_signal()).await
}

/// SIGTERM (Kubernetes) or Ctrl-C.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(err) => {
                tracing::error!(%err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = term => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt"),
    }
}

async fn sidecar(args: Box<SidecarCmd>) -> anyhow::Result<()> {
    let transform = args.transform.transform()?;
    let SidecarCmd { sidecar, s3, .. } = *args;
    stoker_loader::sidecar::run(sidecar, s3.config(), transform, shutdown_signal()).await?;
    Ok(())
}

async fn profile(args: ProfileArgs) -> anyhow::Result<()> {
    let metrics = std::sync::Arc::new(stoker_loader::metrics::LoaderMetrics::new());
    let source = S3Source::connect(&args.s3.config(), metrics).await;
    let cfg = ProfileConfig {
        bucket: args.bucket,
        prefix: args.prefix,
        manifest: args.manifest,
        sample: args.sample,
        transform: args.transform.transform()?,
        target_rate: args.target_rate,
        concurrency: args.concurrency,
        seed: args.seed,
        limits: DecodeLimits::default(),
    };
    let report = run_profile(&source, &cfg).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
