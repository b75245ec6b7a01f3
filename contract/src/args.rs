//! The command lines of `stoker-loader decode` and `stoker-loader sidecar`. Each field's serde
//! name is its clap id, which is how [`crate::LoaderCommand`] renders a struct back into flags.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{DECODER_GRPC_PORT, DECODER_METRICS_PORT, LoaderCommand, SIDECAR_HEALTH_PORT};

fn any_addr(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))
}

// One spelling everywhere: the CRD's `transform.resize.mode`, the loader's `--resize`, the
// decode request's `resize`, the Python client.
/// How an image is brought to the model's input size.
#[derive(
    clap::ValueEnum, JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq,
)]
#[serde(rename_all = "camelCase")]
#[value(rename_all = "camelCase")]
pub enum ResizeMode {
    /// Scale the short side to fit, then center-crop to width × height.
    Crop,
    /// Scale to fit inside width × height, padding the rest.
    Fit,
    /// Qwen2/3-VL "smart resize": keep the aspect ratio, round to patchFactor, clamp pixels.
    QwenSmart,
}

impl ResizeMode {
    /// The mode's one spelling, as serde and clap write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Crop => "crop",
            Self::Fit => "fit",
            Self::QwenSmart => "qwenSmart",
        }
    }
}

/// Where the sidecar puts batches for the trainer.
#[derive(
    clap::ValueEnum, JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "camelCase")]
#[value(rename_all = "camelCase")]
pub enum GpuPlacement {
    /// A page-locked (pinned) ring when the sidecar sees a GPU, so that the trainer's copies
    /// to the device run at full PCIe speed; plain shared memory otherwise.
    #[default]
    Auto,
    /// Always plain shared memory; the trainer copies.
    Host,
}

/// Where objects live. Credentials come from the standard AWS chain (environment variables,
/// profile, web identity, instance metadata), never from flags, and are never logged.
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, PartialEq)]
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
    /// Most bytes one sample's GET may answer with; a larger object is skipped as too_large
    /// from its Content-Length, its body never read.
    #[arg(long, default_value_t = crate::DEFAULT_MAX_OBJECT_BYTES)]
    pub max_object_bytes: u64,
}

/// Mutual TLS between sidecars and decoders: both ends present the pipeline's certificate and
/// accept only a peer whose certificate chains to the installation's CA and names the same
/// pipeline. Unset (local runs, bench): plaintext, with a warning at start.
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct TlsArgs {
    /// Directory of the pipeline's certificates (ca.crt, tls.crt, tls.key), re-read when they
    /// change, so that rotation needs no restart.
    #[arg(long, env = "STOKER_TLS_DIR", requires = "tls_peer_name")]
    pub tls_dir: Option<PathBuf>,
    /// The DNS name a peer's certificate must carry: the pipeline's decoder Service,
    /// `<service>.<namespace>.svc`.
    #[arg(long, env = "STOKER_TLS_PEER_NAME", requires = "tls_dir")]
    pub tls_peer_name: Option<String>,
}

/// The transform: resize mode and its sizes.
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TransformArgs {
    #[arg(long, value_enum, default_value_t = ResizeMode::Crop)]
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

/// `stoker-loader decode`: the gRPC decode worker. Stateless; every request carries its
/// samples and transform, and may only name objects of the pipeline's source (`--bucket`,
/// `--prefix`).
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct DecodeArgs {
    #[arg(long, default_value_t = any_addr(DECODER_GRPC_PORT))]
    pub grpc_addr: SocketAddr,
    #[arg(long, default_value_t = any_addr(DECODER_METRICS_PORT))]
    pub http_addr: SocketAddr,
    /// The only bucket requests may read; others are refused with PERMISSION_DENIED. Unset
    /// (local runs, bench): any bucket, with a warning at start.
    #[arg(long)]
    pub bucket: Option<String>,
    /// Keys requests may read start with this. Unset for manifest pipelines, whose keys may be
    /// anywhere in the bucket.
    #[arg(long, requires = "bucket")]
    pub prefix: Option<String>,
    /// Decode threads; 0 = the container's CPU limit (cgroup v2), else one per core.
    #[arg(long, env = "STOKER_DECODE_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Batches admitted at once; further requests get RESOURCE_EXHAUSTED. 0 = 2 x threads + 2.
    #[arg(long, default_value_t = 0)]
    pub queue_depth: usize,
    /// Largest width x height read from a header before a sample is skipped as too_large.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_source_pixels: u64,
    /// Seconds to wait for in-flight batches after SIGTERM.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout_secs: u64,
    #[command(flatten)]
    #[serde(flatten)]
    pub s3: S3Args,
    #[command(flatten)]
    #[serde(flatten)]
    pub tls: TlsArgs,
}

impl DecodeArgs {
    /// Largest DecodeBatch request a decoder reads: keys and metadata of the largest batch
    /// ([`crate::MAX_BATCH_SAMPLES`] x (a 1 KiB S3 key + 3 KiB of manifest metadata)). Requests
    /// carry no pixels (inline bytes are for tests), so anything larger is refused before it
    /// is buffered.
    pub const MAX_REQUEST_BYTES: u64 = 4 << 20;

    /// Bytes a decode thread may hold for one sample at most: `max_source_pixels` at the widest
    /// decoded layout (RGBA16, 8 bytes), its 8-bit copy (4) and the RGB8 result (3), rounded up.
    pub const DECODE_BYTES_PER_SOURCE_PIXEL: u64 = 16;

    /// Encoded bytes assumed per sample while a batch waits for the pool. Bodies are not capped
    /// yet; typical dataset JPEGs are 50-500 KiB, so this leaves a wide margin.
    pub const ASSUMED_ENCODED_SAMPLE_BYTES: u64 = 2 << 20;

    /// The process itself: runtime, S3 client, allocator slack.
    pub const BASE_MEMORY_BYTES: u64 = 128 << 20;

    /// Batches admitted at once for `threads` decode threads: `--queue-depth`, else enough to
    /// keep the pool busy while the next batches' GETs are in flight.
    pub fn admitted_batches(&self, threads: usize) -> usize {
        if self.queue_depth == 0 {
            threads.max(1) * 2 + 2
        } else {
            self.queue_depth
        }
    }

    /// Requests read at once, admitted or not: twice the admitted batches, so that refusals
    /// (queue full) still answer quickly while request memory stays bounded.
    pub fn requests_in_flight(&self, threads: usize) -> usize {
        self.admitted_batches(threads) * 2
    }

    /// Upper bound on a decoder's memory with `threads` decode threads serving batches of
    /// `batch_samples` outputs of at most `output_pixels` each: every thread decoding its
    /// largest sample, every admitted batch holding its encoded samples and its reply, every
    /// request being read at its size limit, and the process itself.
    pub fn memory_bound(&self, threads: usize, batch_samples: u64, output_pixels: u64) -> u64 {
        let threads = threads.max(1) as u64;
        let decoding = threads
            .saturating_mul(self.max_source_pixels)
            .saturating_mul(Self::DECODE_BYTES_PER_SOURCE_PIXEL);
        let per_batch = batch_samples.saturating_mul(
            Self::ASSUMED_ENCODED_SAMPLE_BYTES.saturating_add(output_pixels.saturating_mul(3)),
        );
        let batches = (self.admitted_batches(threads as usize) as u64).saturating_mul(per_batch);
        let requests = (self.requests_in_flight(threads as usize) as u64)
            .saturating_mul(Self::MAX_REQUEST_BYTES);
        decoding
            .saturating_add(batches)
            .saturating_add(requests)
            .saturating_add(Self::BASE_MEMORY_BYTES)
    }
}

/// `stoker-loader sidecar`: next to the trainer, epoch order, prefetch across the decode
/// workers, shared-memory hand-off.
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SidecarArgs {
    #[arg(long, env = "STOKER_BUCKET")]
    pub bucket: String,
    #[arg(long, env = "STOKER_PREFIX", default_value = "")]
    pub prefix: String,
    /// JSONL manifest (s3://bucket/key or a local path) instead of listing the prefix.
    #[arg(long, env = "STOKER_MANIFEST", conflicts_with = "index")]
    pub manifest: Option<String>,
    /// WebDataset shards through their index (`s3://bucket/prefix/` or a local directory, as
    /// `stoker-loader index --out` wrote it): the plan orders shards and samples within them,
    /// holding O(shards) in memory, instead of listing the prefix.
    #[arg(long, env = "STOKER_INDEX")]
    pub index: Option<String>,
    /// Samples of the shard-aware shuffle's buffer (with --index): larger mixes better and
    /// costs 8 bytes per sample.
    #[arg(long, env = "STOKER_SHUFFLE_WINDOW", default_value_t = crate::DEFAULT_SHUFFLE_WINDOW)]
    pub shuffle_window: usize,
    #[arg(long, env = "STOKER_BATCH_SIZE", default_value_t = 32)]
    pub batch_size: usize,
    #[arg(long, env = "STOKER_SHUFFLE_SEED", default_value_t = 42)]
    pub seed: u64,
    /// Keep the dataset order (evaluation).
    #[arg(long)]
    pub no_shuffle: bool,
    #[arg(long, env = "STOKER_DROP_LAST")]
    pub drop_last: bool,
    /// Global rank of the first trainer served; torchrun's RANK. Unset: node rank × local
    /// ranks. A trainer's client says its own rank when it connects, which wins.
    #[arg(long, env = "RANK")]
    pub rank: Option<u32>,
    /// This pod's place among the job's pods; the first rank served is node rank × local ranks.
    #[arg(long, env = crate::env::NODE_RANK, default_value_t = 0)]
    pub node_rank: u32,
    #[arg(long, env = "WORLD_SIZE", default_value_t = 1)]
    pub world_size: u32,
    /// Local rank of the first trainer served; names its socket (stoker-<local rank>.sock).
    #[arg(long, env = "LOCAL_RANK", default_value_t = 0)]
    pub local_rank: u32,
    /// Trainer processes in the pod served by this sidecar (torchrun's nproc_per_node): ranks
    /// `rank .. rank + local_ranks`, one ring and one socket each. torchrun's LOCAL_WORLD_SIZE.
    #[arg(long, env = crate::env::LOCAL_RANKS, default_value_t = 1)]
    pub local_ranks: u32,
    /// Resume: first epoch to deliver.
    #[arg(long, env = "STOKER_START_EPOCH", default_value_t = 0)]
    pub start_epoch: u64,
    /// Resume: first batch of the first epoch.
    #[arg(long, env = "STOKER_START_BATCH", default_value_t = 0)]
    pub start_batch: u64,
    /// Epochs to deliver (counted from 0); 0 = no end.
    #[arg(long, default_value_t = 0)]
    pub epochs: u64,
    /// Batches decoded ahead of the trainer: the ring holds this many plus `held_batches`.
    #[arg(long, env = "STOKER_PREFETCH_BATCHES", default_value_t = 8)]
    pub prefetch_batches: usize,
    /// Batches the trainer may hold at once.
    #[arg(long, default_value_t = crate::HELD_BATCHES as usize)]
    pub held_batches: usize,
    /// Slot size; default: the batch at the transform's fixed output size (needed for qwenSmart).
    #[arg(long)]
    pub slot_bytes: Option<usize>,
    /// Memory-backed directory for the ring.
    #[arg(long, env = crate::env::SHM_DIR, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Unix socket (one local rank only); default: <shm-dir>/stoker-<local rank>.sock.
    #[arg(long, env = crate::env::SOCKET)]
    pub socket: Option<PathBuf>,
    /// /metrics, /healthz, /readyz, GET /local-share.
    #[arg(long, default_value_t = any_addr(SIDECAR_HEALTH_PORT))]
    pub http_addr: SocketAddr,
    /// Decode workers, comma separated host:port.
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// A DNS name resolving to the decode workers (headless Service), re-resolved periodically.
    #[arg(long, env = "STOKER_WORKERS_DNS")]
    pub workers_dns: Option<String>,
    /// Decode pods from the Kubernetes API: label selector (with --workers-namespace).
    #[arg(long, env = "STOKER_WORKERS_SELECTOR")]
    pub workers_selector: Option<String>,
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub workers_namespace: String,
    #[arg(long, default_value_t = DECODER_GRPC_PORT)]
    pub workers_port: u16,
    #[arg(long, default_value_t = 10)]
    pub discovery_interval_secs: u64,
    /// A batch not answered within this is re-sent to another worker.
    #[arg(long, default_value_t = 30.0)]
    pub batch_timeout_secs: f64,
    /// While S3 fails transiently, a batch is decoded again for this long; then the trainer is
    /// told the source is unavailable (never a batch with samples missing).
    #[arg(long, default_value_t = 600)]
    pub source_retry_secs: u64,
    /// Consecutive failures before a worker is set aside, and for how long.
    #[arg(long, default_value_t = 3)]
    pub max_worker_failures: u32,
    #[arg(long, default_value_t = 10)]
    pub set_aside_secs: u64,
    /// Threads of the in-sidecar decoder; 0 = one per core.
    #[arg(long, env = "STOKER_LOCAL_DECODERS", default_value_t = 0)]
    pub local_decoders: usize,
    /// Share of batches decoded in the sidecar (0..=1) at start. With --pod-name, the operator
    /// changes it through the pod's `stoker.dev/local-share` annotation.
    #[arg(long, env = "STOKER_LOCAL_SHARE", default_value_t = 0.0)]
    pub local_share: f64,
    /// The DataPipeline served (in --workers-namespace): Events about its source go there.
    #[arg(long, env = crate::env::PIPELINE)]
    pub pipeline: Option<String>,
    /// The DataPipeline's uid, which `kubectl describe` matches Events by.
    #[arg(long, env = crate::env::PIPELINE_UID)]
    pub pipeline_uid: Option<String>,
    /// This sidecar's pod (in --workers-namespace), whose local-share annotation it follows.
    #[arg(long, env = crate::env::POD_NAME)]
    pub pod_name: Option<String>,
    /// Never decode locally, even when no worker is reachable.
    #[arg(long)]
    pub no_local_fallback: bool,
    #[arg(long, value_enum, default_value_t = GpuPlacement::Auto)]
    pub gpu_placement: GpuPlacement,
    /// Largest width x height read from a header before a sample is skipped as too_large.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_source_pixels: u64,
    #[command(flatten)]
    #[serde(flatten)]
    pub transform: TransformArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub s3: S3Args,
    #[command(flatten)]
    #[serde(flatten)]
    pub tls: TlsArgs,
}

impl SidecarArgs {
    /// Global rank of the first trainer served: `--rank`, else node rank × local ranks.
    pub fn first_rank(&self) -> u32 {
        self.rank
            .unwrap_or(self.node_rank.saturating_mul(self.local_ranks.max(1)))
    }
}

/// `stoker-loader index`: reads WebDataset shards or Parquet files once and writes the dataset
/// index that sidecars plan over (the operator runs it as a Job for a `webDataset` or `parquet`
/// source).
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, PartialEq)]
// One of --shards and --parquet: the loader says so when neither is given (a required group
// would also bind the rendering's parse of the required flags alone).
#[command(group = clap::ArgGroup::new("dataset").args(["shards", "parquet"]))]
pub struct IndexArgs {
    /// WebDataset shards: `s3://bucket/laion/{00000..04095}.tar`, or `s3://bucket/prefix/` for
    /// every `.tar` under the prefix.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<String>,
    /// Parquet files: `s3://bucket/data/train-{00000..00099}.parquet`, or `s3://bucket/prefix/`
    /// for every `.parquet` under the prefix.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parquet: Option<String>,
    /// Parquet: the column of image bytes (binary, or a struct with a `bytes` field as
    /// Hugging Face datasets write it).
    #[arg(long, default_value = "image")]
    pub image_column: String,
    /// Parquet: columns carried with each sample as its metadata (caption, label, ...).
    #[arg(long, value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<String>,
    /// Where `index.json` and the per-shard tables (`offsets.bin` or `parquet.jsonl`) go:
    /// `s3://bucket/prefix/` (a location apart from the data, so the data's credentials can
    /// stay read-only) or a directory.
    #[arg(long)]
    pub out: String,
    /// Shards read at once.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Also write the summary line here: the operator's Job names `/dev/termination-log`,
    /// which Kubernetes copies into the pod's status for the operator to read.
    #[arg(long)]
    pub summary_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    #[serde(flatten)]
    pub s3: S3Args,
}

/// What `stoker-loader index` reads: the one place the flags naming the files are spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexFiles {
    /// WebDataset tar shards (`--shards`).
    Shards,
    /// Parquet files (`--parquet`).
    Parquet,
}

impl IndexFiles {
    /// The flag that names files of this kind.
    pub const fn flag(self) -> &'static str {
        match self {
            Self::Shards => "--shards",
            Self::Parquet => "--parquet",
        }
    }
}

impl IndexArgs {
    /// The index of `files` written to `out`, every other flag at the loader's default.
    pub fn of(kind: IndexFiles, files: &str, out: &str) -> Result<Self, clap::Error> {
        Self::parse_flags([kind.flag(), files, "--out", out])
    }
}

impl SidecarArgs {
    /// A sidecar of `bucket`'s samples, every other flag at the loader's default.
    pub fn of_bucket(bucket: &str) -> Result<Self, clap::Error> {
        Self::parse_flags(["--bucket", bucket])
    }
}
