//! `stoker-loader bench`: lists a dataset (or plans it over its dataset index: WebDataset shards,
//! Parquet files) and sends it through decode workers as batches, with a fixed number of batches
//! in flight, and reports images/s. A bench command, not a test.

use std::time::Instant;

use clap::Args;
use futures::StreamExt;
use stoker_loader::index::ShardTable;
use stoker_loader::proto;
use stoker_loader::sidecar::plan::{Cursor, PlanConfig, Shard};
use stoker_loader::source::{ManifestLocation, S3Source, SampleRef};
use stoker_loader::worker::{DecodeClient, transform_to_proto};

use crate::{DatasetArgs, s3_config, transform};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Decode worker, e.g. http://127.0.0.1:50051.
    #[arg(long)]
    worker: String,
    #[command(flatten)]
    dataset: DatasetArgs,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    /// Passes over the dataset; the first `warmup` batches are not timed.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    #[arg(long)]
    json: bool,
    /// A dataset index (`stoker-loader index --out`) to plan over instead of listing: batches
    /// as one rank's sidecar would ask for them, with the shard-aware shuffle.
    #[arg(long)]
    index: Option<String>,
    /// Samples in the shard-aware shuffle's window (with --index).
    #[arg(long, default_value_t = stoker_contract::DEFAULT_SHUFFLE_WINDOW)]
    shuffle_window: usize,
}

/// Every epoch's batches: the listing in order, or the index's shard-aware plan (resolved to
/// byte ranges here, before the clock starts: that is the sidecar's work, not the decoder's).
async fn planned_batches(
    args: &BenchArgs,
    source: &S3Source,
) -> anyhow::Result<(String, Vec<Vec<SampleRef>>)> {
    let data = &args.dataset;
    let batch_size = args.batch_size.max(1);
    let mut batches = Vec::new();
    let Some(index) = &args.index else {
        let keys = source.list(&data.bucket, &data.prefix, 1000).await?;
        anyhow::ensure!(
            !keys.is_empty(),
            "no objects under s3://{}/{}",
            data.bucket,
            data.prefix
        );
        for _ in 0..args.epochs.max(1) {
            batches.extend(keys.chunks(batch_size).map(<[SampleRef]>::to_vec));
        }
        return Ok((data.bucket.clone(), batches));
    };
    let table = ShardTable::load(source, ManifestLocation::parse(index)).await?;
    let plan = PlanConfig {
        seed: 0,
        batch_size,
        drop_last: false,
        shuffle: true,
        shard: Shard {
            rank: 0,
            world_size: 1,
        },
    };
    for epoch in 0..args.epochs.max(1) as u64 {
        let from = Cursor { epoch, position: 0 };
        for b in plan.shard_plan_from(&table.counts, args.shuffle_window, from) {
            batches.push(table.sample_refs(source, &b.samples).await?);
        }
    }
    Ok((table.bucket.clone(), batches))
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let data = &args.dataset;
    let metrics = std::sync::Arc::new(stoker_loader::metrics::LoaderMetrics::new());
    let source = S3Source::connect(&s3_config(&data.s3), metrics).await;
    let (bucket, mut batches) = planned_batches(&args, &source).await?;
    let transform = transform_to_proto(&transform(&data.transform)?);
    let client = DecodeClient::connect(args.worker.clone()).await?;
    let warmup = args.warmup.min(batches.len().saturating_sub(1));
    let run_batches = |list: Vec<Vec<SampleRef>>| {
        let client = client.clone();
        let bucket = bucket.clone();
        let transform = transform.clone();
        futures::stream::iter(list.into_iter().enumerate())
            .map(move |(i, samples)| {
                let mut client = client.clone();
                let req = proto::DecodeBatchRequest {
                    batch_id: i as u64,
                    bucket: bucket.clone(),
                    samples: samples.iter().map(proto::SampleRef::from).collect(),
                    transform: Some(transform.clone()),
                };
                async move {
                    // A full queue is back-pressure: wait a little and try again.
                    loop {
                        match client.decode_batch(req.clone()).await {
                            Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                            }
                            other => return other,
                        }
                    }
                }
            })
            .buffer_unordered(args.in_flight.max(1))
    };
    let timed = batches.split_off(warmup);
    let mut replies = run_batches(batches);
    while let Some(r) = replies.next().await {
        r?;
    }
    let t0 = Instant::now();
    let (mut images, mut skipped, mut bytes) = (0usize, 0usize, 0usize);
    // Each reply is counted and dropped as it arrives, as a trainer consumes batches: holding
    // them all would cost the client page faults on every decoded byte of the run.
    let mut replies = run_batches(timed);
    while let Some(r) = replies.next().await {
        let reply = r?;
        bytes += reply.pixels.len();
        for s in &reply.samples {
            if s.skip_reason.is_empty() {
                images += 1;
            } else {
                skipped += 1;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let rate = images as f64 / secs;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "images": images, "skipped": skipped, "seconds": secs,
                "images_per_second": rate, "decoded_bytes": bytes,
            })
        );
    } else {
        println!("stoker: {images} images ({skipped} skipped) in {secs:.2} s = {rate:.1} images/s");
    }
    Ok(())
}
