//! `stoker-loader sidecar`: runs next to the trainer. It owns the epoch order of its rank
//! ([`plan`]), keeps a bounded number of batches in flight across the decode workers
//! ([`fleet`], [`discovery`]), re-sends a batch whose worker failed, decodes locally when no
//! worker is reachable or when told to, and hands batches to the trainer through a
//! shared-memory ring ([`ring`]) and a unix socket ([`handoff`], [`protocol`]).

pub mod client;
pub mod discovery;
pub mod fleet;
pub mod handoff;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod plan;
pub mod protocol;
pub mod ring;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use crate::decode::DecodeLimits;
use crate::gpu::{self, GpuPlacement, GpuProbe};
use crate::source::{ManifestLocation, S3Config, S3Source, SourceError};
use crate::transform::Transform;
use discovery::{DnsWorkers, KubeWorkers, StaticWorkers, WorkerDiscovery};
use fleet::{DecoderFleet, FleetPolicy};
use metrics::SidecarMetrics;
use pipeline::{BusyTurns, Delivery, Pipeline};
use plan::{PlanConfig, PlanError, Shard};
use protocol::{GpuInfo, HelloInfo};
use ring::{RingError, ShmRing};

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("loading the dataset of s3://{bucket}/{prefix}: {source}")]
    Dataset {
        bucket: String,
        prefix: String,
        #[source]
        source: SourceError,
    },
    #[error("the dataset s3://{bucket}/{prefix} has no samples")]
    EmptyDataset { bucket: String, prefix: String },
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the local decode pool: {detail}")]
    Pool { detail: String },
    #[error("--start-batch {start_batch} is past the {batches_per_epoch} batches of an epoch")]
    StartBatch {
        start_batch: u64,
        batches_per_epoch: u64,
    },
    #[error("--socket names one socket; with --local-ranks {local_ranks} use --shm-dir")]
    SocketWithLocalRanks { local_ranks: u32 },
}

impl SidecarError {
    pub fn category(&self) -> &'static str {
        match self {
            SidecarError::Dataset { .. } => "dataset",
            SidecarError::EmptyDataset { .. } => "empty_dataset",
            SidecarError::Plan(e) => e.category(),
            SidecarError::Ring(e) => e.category(),
            SidecarError::Discovery(e) => e.category(),
            SidecarError::Bind { .. } => "bind",
            SidecarError::Pool { .. } => "pool",
            SidecarError::StartBatch { .. } => "start_batch",
            SidecarError::SocketWithLocalRanks { .. } => "socket_with_local_ranks",
        }
    }
}

/// Flags of `stoker-loader sidecar` (S3 access and the transform come from the shared flags).
#[derive(clap::Args, Debug, Clone)]
pub struct SidecarArgs {
    #[arg(long, env = "STOKER_BUCKET")]
    pub bucket: String,
    #[arg(long, env = "STOKER_PREFIX", default_value = "")]
    pub prefix: String,
    /// JSONL manifest (s3://bucket/key or a local path) instead of listing the prefix.
    #[arg(long, env = "STOKER_MANIFEST")]
    pub manifest: Option<String>,
    #[arg(long, env = "STOKER_BATCH_SIZE", default_value_t = 32)]
    pub batch_size: usize,
    #[arg(long, env = "STOKER_SHUFFLE_SEED", default_value_t = 42)]
    pub seed: u64,
    /// Keep the dataset order (evaluation).
    #[arg(long)]
    pub no_shuffle: bool,
    #[arg(long, env = "STOKER_DROP_LAST")]
    pub drop_last: bool,
    /// This trainer's rank; torchrun's RANK.
    #[arg(long, env = "RANK", default_value_t = 0)]
    pub rank: u32,
    #[arg(long, env = "WORLD_SIZE", default_value_t = 1)]
    pub world_size: u32,
    /// Local rank of the first trainer served; names its socket (stoker-<local rank>.sock).
    #[arg(long, env = "LOCAL_RANK", default_value_t = 0)]
    pub local_rank: u32,
    /// Trainer processes in the pod served by this sidecar (torchrun's nproc_per_node): ranks
    /// `rank .. rank + local_ranks`, one ring and one socket each. torchrun's LOCAL_WORLD_SIZE.
    #[arg(long, env = "STOKER_LOCAL_RANKS", default_value_t = 1)]
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
    #[arg(long, default_value_t = 2)]
    pub held_batches: usize,
    /// Slot size; default: the batch at the transform's fixed output size (needed for qwenSmart).
    #[arg(long)]
    pub slot_bytes: Option<usize>,
    /// Memory-backed directory for the ring.
    #[arg(long, env = "STOKER_SHM_DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Unix socket (one local rank only); default: <shm-dir>/stoker-<local rank>.sock.
    #[arg(long, env = "STOKER_SOCKET")]
    pub socket: Option<PathBuf>,
    /// /metrics, /healthz, /readyz, GET /local-share.
    #[arg(long, env = "STOKER_HTTP_ADDR", default_value = "0.0.0.0:9091")]
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
    #[arg(long, default_value_t = 50051)]
    pub workers_port: u16,
    #[arg(long, default_value_t = 10)]
    pub discovery_interval_secs: u64,
    /// A batch not answered within this is re-sent to another worker.
    #[arg(long, default_value_t = 30.0)]
    pub batch_timeout_secs: f64,
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
    /// This sidecar's pod (in --workers-namespace), whose local-share annotation it follows.
    #[arg(long, env = "STOKER_POD_NAME")]
    pub pod_name: Option<String>,
    /// Never decode locally, even when no worker is reachable.
    #[arg(long)]
    pub no_local_fallback: bool,
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_placement: GpuPlacement,
    /// Largest width x height read from a header before a sample is skipped as too_large.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_source_pixels: u64,
}

impl SidecarArgs {
    /// The socket of the `i`-th local rank served.
    pub fn socket_path(&self, i: u32) -> PathBuf {
        match &self.socket {
            Some(s) if self.local_ranks <= 1 => s.clone(),
            _ => self
                .shm_dir
                .join(format!("stoker-{}.sock", self.local_rank + i)),
        }
    }

    fn discovery(&self) -> Option<Box<dyn WorkerDiscovery>> {
        if let Some(name) = &self.workers_dns {
            return Some(Box::new(DnsWorkers {
                name: name.clone(),
                port: self.workers_port,
            }));
        }
        if !self.workers.is_empty() {
            return Some(Box::new(StaticWorkers(self.workers.clone())));
        }
        None
    }
}

/// Bytes of one batch at a fixed output size; qwenSmart sizes vary, so it assumes one
/// megapixel per image unless --slot-bytes says otherwise (larger samples become skips).
fn default_slot_bytes(transform: &Transform, batch_size: usize) -> usize {
    let per_sample = match *transform {
        Transform::Crop { width, height } | Transform::Fit { width, height, .. } => {
            width as usize * height as usize * 3
        }
        Transform::QwenSmart { .. } => 1024 * 1024 * 3,
    };
    per_sample * batch_size
}

/// A running sidecar: addresses known, serving until the shutdown future resolves.
pub async fn run(
    args: SidecarArgs,
    s3: S3Config,
    transform: Transform,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), SidecarError> {
    let probe = gpu::probe();
    match &probe {
        GpuProbe::Available {
            devices,
            driver_version,
        } => {
            tracing::info!(
                devices,
                driver_version,
                "GPU found: trainers may pin the ring"
            )
        }
        GpuProbe::Unavailable { reason } => tracing::info!(%reason, "GPU placement off"),
    }
    let metrics = Arc::new(SidecarMetrics::new());
    let source = S3Source::connect(&s3, metrics.loader.clone()).await;
    let dataset_err = |source| SidecarError::Dataset {
        bucket: args.bucket.clone(),
        prefix: args.prefix.clone(),
        source,
    };
    let samples = match &args.manifest {
        Some(m) => source.load_manifest(&ManifestLocation::parse(m)).await,
        None => source.list(&args.bucket, &args.prefix, 1000).await,
    }
    .map_err(dataset_err)?;
    if samples.is_empty() {
        return Err(SidecarError::EmptyDataset {
            bucket: args.bucket.clone(),
            prefix: args.prefix.clone(),
        });
    }
    let local_ranks = args.local_ranks.max(1);
    if local_ranks > 1 && args.socket.is_some() {
        return Err(SidecarError::SocketWithLocalRanks { local_ranks });
    }
    let plans: Vec<PlanConfig> = (0..local_ranks)
        .map(|i| PlanConfig {
            seed: args.seed,
            batch_size: args.batch_size,
            drop_last: args.drop_last,
            shuffle: !args.no_shuffle,
            shard: Shard {
                rank: args.rank + i,
                world_size: args.world_size,
            },
        })
        .collect();
    for plan in &plans {
        plan.validate(samples.len())?;
    }
    // Equal on every rank by construction of the plan.
    let batches_per_epoch = plans[0].batches_per_epoch(samples.len()) as u64;
    if args.start_batch >= batches_per_epoch {
        return Err(SidecarError::StartBatch {
            start_batch: args.start_batch,
            batches_per_epoch,
        });
    }
    let samples = Arc::new(samples);
    let slots = args.prefetch_batches.max(1) + args.held_batches.max(1);
    let slot_bytes = args
        .slot_bytes
        .unwrap_or_else(|| default_slot_bytes(&transform, args.batch_size));
    std::fs::create_dir_all(&args.shm_dir).map_err(|source| SidecarError::Bind {
        what: "shm dir",
        addr: args.shm_dir.display().to_string(),
        source,
    })?;
    let threads = if args.local_decoders == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        args.local_decoders
    };
    let local_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("local-decode-{i}"))
        .build()
        .map_err(|e| SidecarError::Pool {
            detail: e.to_string(),
        })?;

    let fleet = Arc::new(DecoderFleet::new(FleetPolicy {
        max_failures: args.max_worker_failures.max(1),
        set_aside_for: Duration::from_secs(args.set_aside_secs),
    }));
    let mut kube_client = None;
    let discovery: Option<Box<dyn WorkerDiscovery>> = match &args.workers_selector {
        Some(selector) => {
            let workers =
                KubeWorkers::connect(args.workers_namespace.clone(), selector.clone()).await?;
            kube_client = Some(workers.client.clone());
            Some(Box::new(workers))
        }
        None => args.discovery(),
    };
    // With no worker source at all, every batch is decoded here.
    let local_share = if discovery.is_none() {
        1.0
    } else {
        args.local_share
    };
    if let Some(d) = discovery {
        match d.discover().await {
            Ok(list) => {
                fleet.update(&list);
                tracing::info!(source = %d.describe(), workers = list.len(), "decode workers");
            }
            Err(err) => tracing::warn!(%err, "first worker discovery failed; retrying"),
        }
        let fleet = fleet.clone();
        let every = Duration::from_secs(args.discovery_interval_secs.max(1));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match d.discover().await {
                    Ok(list) => {
                        let (added, removed) = fleet.update(&list);
                        if added + removed > 0 {
                            tracing::info!(
                                added,
                                removed,
                                workers = list.len(),
                                "decode workers changed"
                            );
                        }
                    }
                    Err(err) => tracing::warn!(%err, reason = err.category(), "worker discovery"),
                }
            }
        });
    }

    let placement_on = args.gpu_placement == GpuPlacement::Auto && probe.is_available();
    let local_pool = Arc::new(local_pool);
    let mut served = Vec::new();
    for (i, plan) in plans.into_iter().enumerate() {
        let local_rank = args.local_rank + i as u32;
        let ring = ShmRing::create(&args.shm_dir, local_rank, slots, slot_bytes)?;
        let pipeline = Arc::new(Pipeline {
            bucket: args.bucket.clone(),
            samples: samples.clone(),
            plan,
            start_epoch: args.start_epoch,
            start_batch: args.start_batch,
            epochs: args.epochs,
            transform,
            limits: DecodeLimits {
                max_pixels: args.max_source_pixels,
            },
            batch_timeout: Duration::from_secs_f64(args.batch_timeout_secs.max(0.001)),
            local_fallback: !args.no_local_fallback,
            local_share: AtomicU64::new(0),
            local_pool: local_pool.clone(),
            source: source.clone(),
            fleet: fleet.clone(),
            ring: ring.clone(),
            delivery: Delivery::default(),
            busy_turns: BusyTurns::default(),
            metrics: metrics.clone(),
        });
        pipeline.set_local_share(local_share);
        let hello = Arc::new(HelloInfo {
            shm_path: ring.path().display().to_string(),
            slots: ring.slots() as u32,
            slot_bytes: ring.slot_bytes() as u64,
            rank: plan.shard.rank,
            world_size: args.world_size,
            batch_size: args.batch_size as u32,
            batches_per_epoch,
            start_epoch: args.start_epoch,
            start_batch: args.start_batch,
            gpu: GpuInfo {
                available: probe.is_available(),
                reason: match &probe {
                    GpuProbe::Unavailable { reason } => Some(reason.clone()),
                    GpuProbe::Available { .. } => None,
                },
                devices: match probe {
                    GpuProbe::Available { devices, .. } => devices,
                    GpuProbe::Unavailable { .. } => 0,
                },
                placement: if placement_on { "pinned_ring" } else { "off" }.into(),
            },
        });
        served.push((pipeline, hello, args.socket_path(i as u32)));
    }

    // The autoscaler's local-decode share, from this pod's annotation.
    if let Some(pod) = args.pod_name.clone() {
        let pipelines: Vec<Arc<Pipeline>> = served.iter().map(|(p, _, _)| p.clone()).collect();
        tokio::spawn(discovery::kube::follow_local_share(
            kube_client,
            args.workers_namespace.clone(),
            pod,
            move |share| {
                for p in &pipelines {
                    p.set_local_share(share);
                }
                tracing::info!(share, "local decode share changed");
            },
        ));
    }

    let socket_listening = Arc::new(AtomicBool::new(false));
    let http_listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|source| SidecarError::Bind {
            what: "http",
            addr: args.http_addr.to_string(),
            source,
        })?;
    let http_addr = http_listener
        .local_addr()
        .map_err(|source| SidecarError::Bind {
            what: "http",
            addr: args.http_addr.to_string(),
            source,
        })?;
    let app = http::router(http::HttpState {
        pipelines: served.iter().map(|(p, _, _)| p.clone()).collect(),
        socket_listening: socket_listening.clone(),
    });
    tokio::spawn(async move {
        if let Err(err) = axum::serve(http_listener, app).await {
            tracing::error!(%err, "http server stopped");
        }
    });

    let mut serving = Vec::new();
    for (pipeline, hello, socket) in &served {
        tokio::spawn(pipeline.clone().run());
        // A socket file left by a previous run of this sidecar would make bind fail.
        let _ = std::fs::remove_file(socket);
        let listener =
            tokio::net::UnixListener::bind(socket).map_err(|source| SidecarError::Bind {
                what: "unix socket",
                addr: socket.display().to_string(),
                source,
            })?;
        serving.push(handoff::serve(listener, pipeline.clone(), hello.clone()));
    }
    socket_listening.store(true, std::sync::atomic::Ordering::SeqCst);
    let sockets: Vec<String> = served
        .iter()
        .map(|(_, _, s)| s.display().to_string())
        .collect();
    let rings: Vec<String> = served
        .iter()
        .map(|(p, _, _)| p.ring.path().display().to_string())
        .collect();
    // Scripts and tests wait for this line to learn the addresses.
    println!(
        "stoker-loader sidecar listening socket={} http={http_addr} shm={}",
        sockets.join(","),
        rings.join(","),
    );
    tracing::info!(
        rank = args.rank,
        local_ranks,
        world_size = args.world_size,
        batches_per_epoch,
        slots,
        slot_bytes,
        "sidecar serving"
    );
    tokio::select! {
        _ = futures::future::join_all(serving) => {}
        () = shutdown => tracing::info!("sidecar stopping"),
    }
    socket_listening.store(false, std::sync::atomic::Ordering::SeqCst);
    for (pipeline, _, socket) in &served {
        let _ = std::fs::remove_file(socket);
        // Tasks still hold the ring, so its Drop may never run before exit: remove the file here.
        let _ = std::fs::remove_file(pipeline.ring.path());
    }
    Ok(())
}
