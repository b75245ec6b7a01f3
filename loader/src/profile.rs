//! `stoker-loader profile`: the real path on a sample of the user's data, timed per stage, with
//! images/s per core and the cores needed for a target rate.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

use crate::batch::{EncodedSample, decode_batch};
use crate::decode::DecodeLimits;
use crate::source::{ManifestLocation, S3Source, SampleRef, SourceError};
use crate::transform::Transform;

#[derive(Debug, Clone)]
pub struct ProfileConfig {
    pub bucket: String,
    pub prefix: String,
    /// JSONL manifest (`s3://...` or a path) instead of listing.
    pub manifest: Option<String>,
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
    pub decode_ms_per_image: f64,
    pub resize_ms_per_image: f64,
    pub pack_ms_per_image: f64,
    pub images_per_second_per_core: f64,
    pub encoded_bytes_per_image: f64,
    pub decoded_bytes_per_image: f64,
    pub target_images_per_second: f64,
    pub cores_needed: f64,
    /// Decoded bytes per second leaving the decoders at the target rate, in Gbit/s.
    pub egress_gbit_per_s_at_target: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

pub async fn run_profile(
    source: &S3Source,
    cfg: &ProfileConfig,
) -> Result<ProfileReport, SourceError> {
    let t_list = Instant::now();
    let all: Vec<SampleRef> = match &cfg.manifest {
        Some(m) => source.load_manifest(&ManifestLocation::parse(m)).await?,
        None => source.list(&cfg.bucket, &cfg.prefix, 1000).await?,
    };
    let list_seconds = t_list.elapsed().as_secs_f64();
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let mut picked = all.clone();
    rng.shuffle(&mut picked);
    picked.truncate(cfg.sample.max(1));

    // GETs at the configured concurrency, each timed.
    let t_get = Instant::now();
    let fetched: Vec<(EncodedSample, Duration)> = futures::stream::iter(picked)
        .map(|s| async move {
            let t0 = Instant::now();
            let data = source
                .get(&cfg.bucket, &s.key)
                .await
                .map_err(|e| e.skip_reason());
            (
                EncodedSample {
                    key: s.key,
                    metadata: s.metadata,
                    data,
                },
                t0.elapsed(),
            )
        })
        .buffer_unordered(cfg.concurrency.max(1))
        .collect()
        .await;
    let get_wall = t_get.elapsed();
    let mut lat: Vec<Duration> = fetched.iter().map(|(_, d)| *d).collect();
    lat.sort();
    let encoded_total: usize = fetched
        .iter()
        .map(|(s, _)| s.data.as_ref().map_or(0, |b| b.len()))
        .sum();
    let samples: Vec<EncodedSample> = fetched.into_iter().map(|(s, _)| s).collect();
    let sampled = samples.len();

    // CPU stages on one thread, so per-image times are per core.
    let transform = cfg.transform;
    let limits = cfg.limits;
    let cpu = tokio::task::spawn_blocking(move || {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build();
        let run = |samples: &[EncodedSample]| {
            let mut agg = (
                Duration::ZERO,
                Duration::ZERO,
                Duration::ZERO,
                0usize,
                0usize,
            );
            let mut skips: BTreeMap<String, u64> = BTreeMap::new();
            let t0 = Instant::now();
            let c0 = crate::batch::thread_cpu_time();
            for chunk in samples.chunks(32) {
                let b = decode_batch(chunk, &transform, &limits);
                agg.0 += b.timings.decode_cpu;
                agg.1 += b.timings.resize_cpu;
                agg.2 += b.timings.pack_wall;
                agg.3 += b.decoded_count();
                agg.4 += b.pixels.len();
                for s in &b.samples {
                    if let Some(r) = s.skip {
                        *skips.entry(r.as_str().to_string()).or_default() += 1;
                    }
                }
            }
            let cpu = crate::batch::thread_cpu_time().saturating_sub(c0);
            (agg, skips, t0.elapsed(), cpu.as_secs_f64())
        };
        match pool {
            Ok(p) => p.install(|| run(&samples)),
            Err(_) => run(&samples),
        }
    })
    .await
    .unwrap_or_default();
    let ((decode, resize, pack, decoded, out_bytes), skips, wall, cpu_secs) = cpu;

    let n = decoded.max(1) as f64;
    // Per core from the thread's CPU time, not wall time: on a busy node other processes'
    // time slices would count as ours. One thread did all the work.
    let per_core = if cpu_secs > 0.0 {
        decoded as f64 / cpu_secs
    } else if !wall.is_zero() {
        decoded as f64 / wall.as_secs_f64()
    } else {
        0.0
    };
    let decoded_bytes_per_image = out_bytes as f64 / n;
    Ok(ProfileReport {
        transform: transform.name().to_string(),
        listed_objects: all.len(),
        list_seconds,
        sampled,
        decoded,
        skips,
        get_p50_ms: percentile(&lat, 0.5),
        get_p90_ms: percentile(&lat, 0.9),
        get_mb_per_s: encoded_total as f64 / 1e6 / get_wall.as_secs_f64().max(1e-9),
        get_concurrency: cfg.concurrency,
        decode_ms_per_image: decode.as_secs_f64() * 1000.0 / n,
        resize_ms_per_image: resize.as_secs_f64() * 1000.0 / n,
        pack_ms_per_image: pack.as_secs_f64() * 1000.0 / n,
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
                "decode per image".into(),
                format!("{:.2} ms", self.decode_ms_per_image),
            ),
            (
                "resize per image".into(),
                format!("{:.2} ms", self.resize_ms_per_image),
            ),
            (
                "pack per image".into(),
                format!("{:.3} ms", self.pack_ms_per_image),
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
