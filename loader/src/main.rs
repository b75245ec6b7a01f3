//! `stoker-loader`: `decode` (the gRPC decode worker), `profile` (timing breakdown on a sample
//! of a dataset), `bench` (drives decode workers with real batches and reports images/s) and
//! `index` (the dataset index of WebDataset shards or Parquet files).

mod bench;

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use stoker_contract::{DecodeArgs, IndexArgs, S3Args, SidecarArgs, TransformArgs};
use stoker_loader::decode::DecodeLimits;
use stoker_loader::profile::{ProfileConfig, run_profile};
use stoker_loader::source::{S3Config, S3Source};
use stoker_loader::transform::Transform;
use stoker_loader::worker::{DecodeServer, SourceScope, WorkerConfig};

#[derive(Parser)]
#[command(name = "stoker-loader", version, about = "stoker's data plane")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve DecodeBatch over gRPC, with /metrics, /healthz and /readyz over HTTP.
    Decode(Box<DecodeArgs>),
    /// Time list, GET, decode, resize and pack on a sample of a dataset.
    Profile(ProfileArgs),
    /// Send a dataset through decode workers as batches and report images/s.
    Bench(bench::BenchArgs),
    /// Next to the trainer: epoch order, prefetch across decode workers, shared-memory hand-off.
    Sidecar(Box<SidecarArgs>),
    /// Read WebDataset shards or Parquet files once and write the dataset index (per shard:
    /// sample count and where each sample lies) that sidecars read instead of listing.
    Index(IndexArgs),
}

/// S3 settings for the loader's S3 client.
fn s3_config(args: &S3Args) -> S3Config {
    let mut c = S3Config {
        endpoint: args.endpoint.clone(),
        region: args.region.clone(),
        force_path_style: args.force_path_style,
        max_concurrent_gets: args.max_concurrent_gets,
        max_object_bytes: args.max_object_bytes,
        ..S3Config::default()
    };
    c.retry.max_attempts = args.max_attempts.max(1);
    c
}

/// The transform the flags name, checked.
fn transform(args: &TransformArgs) -> anyhow::Result<Transform> {
    Ok(Transform::from_args(args)?)
}

/// A dataset in S3 and the transform to run on it (`profile`, `bench`).
#[derive(Args, Debug)]
pub struct DatasetArgs {
    #[arg(long)]
    pub bucket: String,
    #[arg(long, default_value = "")]
    pub prefix: String,
    #[command(flatten)]
    pub transform: TransformArgs,
    #[command(flatten)]
    pub s3: S3Args,
}

#[derive(Args, Debug)]
struct ProfileArgs {
    #[command(flatten)]
    dataset: DatasetArgs,
    /// JSONL manifest, s3://bucket/key or a local path, instead of listing.
    #[arg(long)]
    manifest: Option<String>,
    /// A dataset index (`stoker-loader index --out`: WebDataset shards, Parquet files) instead
    /// of listing: samples are fetched in planned batches with coalesced range GETs, and the
    /// GET rows show what the shard size costs.
    #[arg(long, conflicts_with = "manifest")]
    index: Option<String>,
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
            Command::Index(args) => index(args).await,
        }
    })
}

async fn decode(args: Box<DecodeArgs>) -> anyhow::Result<()> {
    let config = WorkerConfig {
        grpc_addr: args.grpc_addr,
        http_addr: args.http_addr,
        threads: args.threads,
        queue_depth: args.queue_depth,
        limits: DecodeLimits {
            max_pixels: args.max_source_pixels,
        },
        s3: Some(s3_config(&args.s3)),
        scope: args.bucket.clone().map(|bucket| SourceScope {
            bucket,
            prefix: args.prefix.clone().unwrap_or_default(),
        }),
        drain_timeout: Duration::from_secs(args.drain_timeout_secs),
        tls: stoker_loader::worker::PipelineTls::from_args(&args.tls)?,
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

async fn sidecar(args: Box<SidecarArgs>) -> anyhow::Result<()> {
    let transform = transform(&args.transform)?;
    let s3 = s3_config(&args.s3);
    stoker_loader::sidecar::run(*args, s3, transform, shutdown_signal()).await?;
    Ok(())
}

async fn index(args: IndexArgs) -> anyhow::Result<()> {
    use stoker_loader::index;
    let t0 = std::time::Instant::now();
    let metrics = std::sync::Arc::new(stoker_loader::metrics::LoaderMetrics::new());
    let source = S3Source::connect(&s3_config(&args.s3), metrics).await;
    let (built, offsets) = match (&args.shards, &args.parquet) {
        (Some(shards), None) => {
            let (bucket, keys) = index::resolve_shards(&source, shards, ".tar").await?;
            index::build_webdataset(&source, &bucket, &keys, args.parallel).await?
        }
        (None, Some(files)) => {
            let (bucket, keys) = index::resolve_shards(&source, files, ".parquet").await?;
            let columns = index::parquet::ParquetColumns {
                image: args.image_column.clone(),
                fields: args.columns.clone(),
            };
            index::build_parquet(&source, &bucket, &keys, &columns, args.parallel).await?
        }
        _ => anyhow::bail!("name the dataset: --shards (WebDataset) or --parquet (Parquet files)"),
    };
    for p in &built.problems {
        tracing::warn!(key = %p.key, offset = p.offset, reason = %p.reason, "left out of the index");
    }
    let location = stoker_loader::source::ManifestLocation::parse(&args.out);
    let offsets_bytes = offsets.len();
    index::write_index(&source, &location, &built, offsets).await?;
    // One JSON line for the operator's Job and for scripts.
    let summary = serde_json::json!({
        "index": location.to_string(),
        "shards": built.shards.len(),
        "samples": built.samples,
        "shardBytes": built.shards.iter().map(|s| s.bytes).sum::<u64>(),
        "offsetsBytes": offsets_bytes,
        "problems": built.problems.len(),
        "seconds": t0.elapsed().as_secs_f64(),
    })
    .to_string();
    println!("{summary}");
    if let Some(path) = &args.summary_file {
        std::fs::write(path, &summary)
            .map_err(|e| anyhow::anyhow!("writing the summary to {}: {e}", path.display()))?;
    }
    Ok(())
}

async fn profile(args: ProfileArgs) -> anyhow::Result<()> {
    let metrics = std::sync::Arc::new(stoker_loader::metrics::LoaderMetrics::new());
    let DatasetArgs {
        bucket,
        prefix,
        transform: transform_args,
        s3,
    } = args.dataset;
    let source = S3Source::connect(&s3_config(&s3), metrics.clone()).await;
    let cfg = ProfileConfig {
        bucket,
        prefix,
        manifest: args.manifest,
        index: args.index,
        sample: args.sample,
        transform: transform(&transform_args)?,
        target_rate: args.target_rate,
        concurrency: args.concurrency,
        seed: args.seed,
        limits: DecodeLimits::default(),
    };
    let report = run_profile(&source, &metrics, &cfg).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_contract::LoaderCommand;

    /// The loader's own command line takes what the operator renders from the contract.
    #[test]
    fn the_cli_takes_the_operators_command_lines() {
        let argv = |line: Vec<String>| std::iter::once("stoker-loader".to_string()).chain(line);
        let sidecar = SidecarArgs::parse_flags(["--bucket", "b", "--resize", "qwenSmart"])
            .expect("sidecar flags");
        let line = sidecar.command_line().expect("renders");
        match Cli::try_parse_from(argv(line)).expect("parses").command {
            Command::Sidecar(parsed) => assert_eq!(*parsed, sidecar),
            _ => panic!("not the sidecar"),
        }
        let decode = DecodeArgs::parse_flags(["--threads", "3", "--bucket", "b", "--prefix", "p/"])
            .expect("decode flags");
        let line = decode.command_line().expect("renders");
        match Cli::try_parse_from(argv(line)).expect("parses").command {
            Command::Decode(parsed) => assert_eq!(*parsed, decode),
            _ => panic!("not decode"),
        }
    }
}
