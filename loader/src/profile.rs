//! `stoker-loader profile`: the real path on a sample of the user's data, timed per stage, with
//! images/s per core and the cores needed for a target rate. Over a dataset index (WebDataset
//! shards, Parquet files) the sample is fetched as a decode worker fetches batches (coalesced
//! range GETs), and the GET rows say what a shard size costs: requests and bytes per image, the
//! size of a GET and the throughput of one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

use crate::batch::{EncodedSample, PixelPool, decode_batch_pooled};
use crate::decode::DecodeLimits;
use crate::index::{IndexError, ShardTable};
use crate::metrics::LoaderMetrics;
use crate::sidecar::plan::{Cursor, PlanConfig, Shard};
use crate::source::{CoalescePolicy, ManifestLocation, S3Source, SampleRef, fetch_samples};
use crate::transform::Transform;

#[derive(Debug, Clone)]
pub struct ProfileConfig {
    pub bucket: String,
    pub prefix: String,
    /// JSONL manifest (`s3://...` or a path) instead of listing.
    pub manifest: Option<String>,
    /// A dataset index (`stoker-loader index --out`) instead of listing: the sample is drawn
    /// in batches of 32 as a sidecar plans them, and fetched with coalesced range GETs.
    pub index: Option<String>,
    /// Objects to sample.
    pub sample: usize,
    pub transform: Transform,
    /// Images/s the cluster must deliver; sizes the "cores needed" row.
    pub target_rate: f64,
    /// GETs in flight while sampling.
    pub concurrency: usize,
    pub seed: u64,
    pub limits: DecodeLimits,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct ProfileReport {
    pub transform: String,
    pub listed_objects: usize,
    pub list_seconds: f64,
    pub sampled: usize,
    pub decoded: usize,
    pub skips: BTreeMap<String, u64>,
    pub get_p50_ms: f64,
    pub get_p90_ms: f64,
    pub get_mb_per_s: f64,
    pub get_concurrency: usize,
    /// GET requests per sampled image: 1 for objects, fewer when a range GET carries several
    /// samples of a shard.
    pub get_requests_per_image: f64,
    /// Mean bytes one GET returned.
    pub get_bytes_per_request: f64,
    /// Bytes read per sampled image: above the encoded size when a GET reads more than the
    /// sample (gaps between coalesced samples, a Parquet page's other rows).
    pub get_bytes_per_image: f64,
    /// Throughput of one GET: its bytes over its own latency, averaged over the bytes.
    pub get_mb_per_s_per_request: f64,
    /// CPU of the whole process while fetching (request signing, HTTP, body copies), per
    /// sampled object.
    pub get_cpu_ms_per_image: f64,
    pub decode_ms_per_image: f64,
    pub resize_ms_per_image: f64,
    /// Everything else of a batch on the decode thread: probing headers, the batch buffer,
    /// closing holes left by skipped samples.
    pub pack_ms_per_image: f64,
    /// Decode-path CPU per decoded image: decode + resize + pack.
    pub cpu_ms_per_image: f64,
    /// Encoding the gRPC reply a decode worker sends (protobuf: sample metadata and the
    /// pixels, copied once into the message), per decoded image.
    pub reply_cpu_ms_per_image: f64,
    /// Everything a decode worker spends per image: get + decode path + reply.
    pub all_cpu_ms_per_image: f64,
    /// Share of `all_cpu_ms_per_image` outside decode + resize + pack (get and reply), in %.
    pub outside_decode_percent: f64,
    /// Decode path only (GET not counted): 1000 / `cpu_ms_per_image`.
    pub images_per_second_per_core: f64,
    pub encoded_bytes_per_image: f64,
    pub decoded_bytes_per_image: f64,
    pub target_images_per_second: f64,
    pub cores_needed: f64,
    /// Decoded bytes per second leaving the decoders at the target rate, in Gbit/s.
    pub egress_gbit_per_s_at_target: f64,
}

/// CPU time of the decode thread by stage, and what it produced.
#[derive(Debug, Default)]
struct CpuStages {
    decode: Duration,
    resize: Duration,
    pack: Duration,
    reply: Duration,
    decoded: usize,
    out_bytes: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// GET totals from the source's metrics: requests, bytes, and seconds spent in them.
fn get_totals(metrics: &LoaderMetrics) -> (f64, f64, f64) {
    let text = metrics.encode();
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        value("stoker_loader_s3_requests_total{op=\"get_object\"}"),
        value("stoker_loader_bytes_in_total"),
        value("stoker_loader_stage_seconds_sum{stage=\"get\"}"),
    )
}

/// The sample, as samples a worker would be asked for: how many the source holds, how long
/// finding them took, and the picked ones (in batches: one for a listing, whose samples are
/// fetched one GET each; batches of 32 from the shard plan for an index).
async fn pick(
    source: &S3Source,
    cfg: &ProfileConfig,
) -> Result<(usize, f64, String, Vec<Vec<SampleRef>>), IndexError> {
    let t_list = Instant::now();
    if let Some(index) = &cfg.index {
        let table = ShardTable::load(source, ManifestLocation::parse(index)).await?;
        let plan = PlanConfig {
            seed: cfg.seed,
            batch_size: 32,
            drop_last: false,
            shuffle: true,
            shard: Shard {
                rank: 0,
                world_size: 1,
            },
        };
        let window = stoker_contract::DEFAULT_SHUFFLE_WINDOW;
        let mut batches = Vec::new();
        let mut picked = 0;
        for b in plan.shard_plan_from(&table.counts, window, Cursor::default()) {
            if picked >= cfg.sample.max(1) {
                break;
            }
            let mut refs = table.sample_refs(source, &b.samples).await?;
            refs.truncate(cfg.sample.max(1) - picked);
            picked += refs.len();
            batches.push(refs);
        }
        let total = table.counts.iter().map(|&c| c as usize).sum();
        return Ok((total, t_list.elapsed().as_secs_f64(), table.bucket, batches));
    }
    let all: Vec<SampleRef> = match &cfg.manifest {
        Some(m) => source.load_manifest(&ManifestLocation::parse(m)).await?,
        None => source.list(&cfg.bucket, &cfg.prefix, 1000).await?,
    };
    let list_seconds = t_list.elapsed().as_secs_f64();
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let mut picked = all.clone();
    rng.shuffle(&mut picked);
    picked.truncate(cfg.sample.max(1));
    Ok((all.len(), list_seconds, cfg.bucket.clone(), vec![picked]))
}

pub async fn run_profile(
    source: &S3Source,
    metrics: &LoaderMetrics,
    cfg: &ProfileConfig,
) -> Result<ProfileReport, IndexError> {
    let (listed, list_seconds, bucket, batches) = pick(source, cfg).await?;
    let indexed = cfg.index.is_some();
    let bucket = bucket.as_str();

    // GETs at the configured concurrency, each timed: one per object, or one batch's coalesced
    // range GETs (then the latency is the batch's).
    let (requests0, bytes0, seconds0) = get_totals(metrics);
    let t_get = Instant::now();
    let c_get = crate::batch::process_cpu_time();
    let units: Vec<Vec<SampleRef>> = match indexed {
        true => batches,
        false => batches.into_iter().flatten().map(|s| vec![s]).collect(),
    };
    let in_flight = match indexed {
        true => cfg.concurrency.div_ceil(8).max(1),
        false => cfg.concurrency.max(1),
    };
    let fetched: Vec<(Vec<EncodedSample>, Duration)> = futures::stream::iter(units)
        .map(|refs| async move {
            let t0 = Instant::now();
            let got = fetch_samples(Some(source), bucket, &refs, CoalescePolicy::default()).await;
            (got, t0.elapsed())
        })
        .buffer_unordered(in_flight)
        .collect()
        .await;
    let get_wall = t_get.elapsed();
    let get_cpu = crate::batch::process_cpu_time().saturating_sub(c_get);
    let (requests1, bytes1, seconds1) = get_totals(metrics);
    let (requests, read, get_seconds) =
        (requests1 - requests0, bytes1 - bytes0, seconds1 - seconds0);
    let mut lat: Vec<Duration> = fetched.iter().map(|(_, d)| *d).collect();
    lat.sort();
    let samples: Vec<EncodedSample> = fetched.into_iter().flat_map(|(s, _)| s).collect();
    let encoded_total: usize = samples
        .iter()
        .map(|s| s.data.as_ref().map_or(0, |b| b.len()))
        .sum();
    let sampled = samples.len();

    // CPU stages on one thread, so per-image times are per core.
    let transform = cfg.transform;
    let limits = cfg.limits;
    let cpu = tokio::task::spawn_blocking(move || {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build();
        // As a decode worker runs: batches into pooled buffers, each then encoded as a reply.
        let pixels = PixelPool::new(2);
        let run = |samples: &[EncodedSample]| {
            let mut stages = CpuStages::default();
            let mut skips: BTreeMap<String, u64> = BTreeMap::new();
            let t0 = Instant::now();
            for (i, chunk) in samples.chunks(32).enumerate() {
                let chunk = chunk.to_vec();
                let c0 = crate::batch::thread_cpu_time();
                let b = decode_batch_pooled(chunk, &transform, &limits, &pixels);
                let batch_cpu = crate::batch::thread_cpu_time().saturating_sub(c0);
                let (decode, resize) = (b.timings.decode_cpu, b.timings.resize_cpu);
                stages.decode += decode;
                stages.resize += resize;
                stages.pack += batch_cpu.saturating_sub(decode + resize);
                stages.decoded += b.decoded_count();
                stages.out_bytes += b.pixels.len();
                for s in &b.samples {
                    if let Some(r) = s.skip {
                        *skips.entry(r.as_str().to_string()).or_default() += 1;
                    }
                }
                let c1 = crate::batch::thread_cpu_time();
                let reply = crate::worker::encode_reply(i as u64, b);
                stages.reply += crate::batch::thread_cpu_time().saturating_sub(c1);
                drop(reply);
            }
            (stages, skips, t0.elapsed())
        };
        match pool {
            Ok(p) => p.install(|| run(&samples)),
            Err(_) => run(&samples),
        }
    })
    .await
    .unwrap_or_default();
    let (stages, skips, wall) = cpu;
    let CpuStages {
        decode,
        resize,
        pack,
        reply,
        decoded,
        out_bytes,
    } = stages;

    let n = decoded.max(1) as f64;
    // Per core from the thread's CPU time, not wall time: on a busy node other processes'
    // time slices would count as ours. One thread did all the work.
    let cpu_secs = (decode + resize + pack).as_secs_f64();
    let per_core = if cpu_secs > 0.0 {
        decoded as f64 / cpu_secs
    } else if !wall.is_zero() {
        decoded as f64 / wall.as_secs_f64()
    } else {
        0.0
    };
    let decoded_bytes_per_image = out_bytes as f64 / n;
    let get_ms = get_cpu.as_secs_f64() * 1000.0 / sampled.max(1) as f64;
    let reply_ms = reply.as_secs_f64() * 1000.0 / n;
    let all_ms = get_ms + cpu_secs * 1000.0 / n + reply_ms;
    let per_sample = |x: f64| x / sampled.max(1) as f64;
    Ok(ProfileReport {
        transform: transform.name().to_string(),
        listed_objects: listed,
        list_seconds,
        sampled,
        decoded,
        skips,
        get_p50_ms: percentile(&lat, 0.5),
        get_p90_ms: percentile(&lat, 0.9),
        get_mb_per_s: encoded_total as f64 / 1e6 / get_wall.as_secs_f64().max(1e-9),
        get_concurrency: cfg.concurrency,
        get_requests_per_image: per_sample(requests),
        get_bytes_per_request: read / requests.max(1.0),
        get_bytes_per_image: per_sample(read),
        get_mb_per_s_per_request: if get_seconds > 0.0 {
            read / 1e6 / get_seconds
        } else {
            0.0
        },
        get_cpu_ms_per_image: get_ms,
        decode_ms_per_image: decode.as_secs_f64() * 1000.0 / n,
        resize_ms_per_image: resize.as_secs_f64() * 1000.0 / n,
        pack_ms_per_image: pack.as_secs_f64() * 1000.0 / n,
        cpu_ms_per_image: cpu_secs * 1000.0 / n,
        reply_cpu_ms_per_image: reply_ms,
        all_cpu_ms_per_image: all_ms,
        outside_decode_percent: if all_ms > 0.0 {
            (get_ms + reply_ms) / all_ms * 100.0
        } else {
            0.0
        },
        images_per_second_per_core: per_core,
        encoded_bytes_per_image: encoded_total as f64 / sampled.max(1) as f64,
        decoded_bytes_per_image,
        target_images_per_second: cfg.target_rate,
        cores_needed: if per_core > 0.0 {
            cfg.target_rate / per_core
        } else {
            0.0
        },
        egress_gbit_per_s_at_target: cfg.target_rate * decoded_bytes_per_image * 8.0 / 1e9,
    })
}

impl ProfileReport {
    /// The human table.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, String)> = vec![
            ("transform".into(), self.transform.clone()),
            (
                "objects listed".into(),
                format!("{} in {:.2} s", self.listed_objects, self.list_seconds),
            ),
            (
                "sampled / decoded".into(),
                format!("{} / {}", self.sampled, self.decoded),
            ),
            (
                "GET latency p50 / p90".into(),
                format!("{:.1} ms / {:.1} ms", self.get_p50_ms, self.get_p90_ms),
            ),
            (
                "GET throughput".into(),
                format!(
                    "{:.1} MB/s at {} in flight",
                    self.get_mb_per_s, self.get_concurrency
                ),
            ),
            (
                "GET requests per image".into(),
                format!("{:.3}", self.get_requests_per_image),
            ),
            (
                "GET size".into(),
                format!("{:.1} KB", self.get_bytes_per_request / 1e3),
            ),
            (
                "GET bytes per image".into(),
                format!(
                    "{:.1} KB ({:.2}x the image)",
                    self.get_bytes_per_image / 1e3,
                    self.get_bytes_per_image / self.encoded_bytes_per_image.max(1.0)
                ),
            ),
            (
                "throughput per GET".into(),
                format!("{:.1} MB/s", self.get_mb_per_s_per_request),
            ),
            (
                "CPU per image: get".into(),
                format!("{:.3} ms", self.get_cpu_ms_per_image),
            ),
            (
                "CPU per image: decode".into(),
                format!("{:.3} ms", self.decode_ms_per_image),
            ),
            (
                "CPU per image: resize".into(),
                format!("{:.3} ms", self.resize_ms_per_image),
            ),
            (
                "CPU per image: pack".into(),
                format!("{:.3} ms", self.pack_ms_per_image),
            ),
            (
                "CPU per image: decode path".into(),
                format!("{:.3} ms", self.cpu_ms_per_image),
            ),
            (
                "CPU per image: reply".into(),
                format!("{:.3} ms", self.reply_cpu_ms_per_image),
            ),
            (
                "CPU per image: all".into(),
                format!("{:.3} ms", self.all_cpu_ms_per_image),
            ),
            (
                "CPU outside decode path".into(),
                format!("{:.1} %", self.outside_decode_percent),
            ),
            (
                "images/s per core".into(),
                format!("{:.0}", self.images_per_second_per_core),
            ),
            (
                "bytes per image enc → dec".into(),
                format!(
                    "{:.0} KB → {:.0} KB ({:.1}x)",
                    self.encoded_bytes_per_image / 1e3,
                    self.decoded_bytes_per_image / 1e3,
                    self.decoded_bytes_per_image / self.encoded_bytes_per_image.max(1.0)
                ),
            ),
            (
                format!("cores for {:.0} images/s", self.target_images_per_second),
                format!("{:.1}", self.cores_needed),
            ),
            (
                "decoded egress at target".into(),
                format!("{:.2} Gbit/s", self.egress_gbit_per_s_at_target),
            ),
        ];
        for (reason, count) in &self.skips {
            rows.push((format!("skipped: {reason}"), count.to_string()));
        }
        let w = rows
            .iter()
            .map(|(k, _)| k.chars().count())
            .max()
            .unwrap_or(0);
        rows.iter()
            .map(|(k, v)| format!("{k:<w$}  {v}\n"))
            .collect()
    }
}
