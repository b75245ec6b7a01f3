//! `stoker-loader bench`: lists a dataset and sends it through decode workers as batches, with a
//! fixed number of batches in flight, and reports images/s. A bench command, not a test.

use std::time::Instant;

use clap::Args;
use futures::StreamExt;
use stoker_loader::proto;
use stoker_loader::source::S3Source;
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
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let data = &args.dataset;
    let metrics = std::sync::Arc::new(stoker_loader::metrics::LoaderMetrics::new());
    let source = S3Source::connect(&s3_config(&data.s3), metrics).await;
    let keys = source.list(&data.bucket, &data.prefix, 1000).await?;
    anyhow::ensure!(
        !keys.is_empty(),
        "no objects under s3://{}/{}",
        data.bucket,
        data.prefix
    );
    let transform = transform_to_proto(&transform(&data.transform)?);
    let client = DecodeClient::connect(args.worker.clone()).await?;
    let mut batches = Vec::new();
    for _ in 0..args.epochs.max(1) {
        for chunk in keys.chunks(args.batch_size.max(1)) {
            batches.push(chunk.to_vec());
        }
    }
    let warmup = args.warmup.min(batches.len().saturating_sub(1));
    let run_batches = |list: Vec<Vec<stoker_loader::source::SampleRef>>| {
        let client = client.clone();
        let bucket = data.bucket.clone();
        let transform = transform.clone();
        futures::stream::iter(list.into_iter().enumerate())
            .map(move |(i, samples)| {
                let mut client = client.clone();
                let req = proto::DecodeBatchRequest {
                    batch_id: i as u64,
                    bucket: bucket.clone(),
                    samples: samples
                        .into_iter()
                        .map(|s| proto::SampleRef {
                            key: s.key,
                            metadata: s.metadata,
                            ..Default::default()
                        })
                        .collect(),
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
            .collect::<Vec<_>>()
    };
    let timed = batches.split_off(warmup);
    for r in run_batches(batches).await {
        r?;
    }
    let t0 = Instant::now();
    let (mut images, mut skipped, mut bytes) = (0usize, 0usize, 0usize);
    for r in run_batches(timed).await {
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
