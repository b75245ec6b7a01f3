//! The stages of [`super::run`], in the order it calls them: what the sidecar needs before it
//! serves (the dataset, one epoch plan and ring per local rank, the decode workers), the
//! servers that hand batches to the trainers, and the clean-up at shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::discovery::{self, DnsWorkers, KubeWorkers, StaticWorkers, WorkerDiscovery};
use super::fleet::{FleetPolicy, WorkerPool};
use super::metrics::SidecarMetrics;
use super::pipeline::{BusyTurns, Delivery, Pipeline, Stream};
use super::plan::{Cursor, PlanConfig, PlanError, Shard};
use super::protocol::{GpuInfo, HelloInfo};
use super::ring::{SHARED_MODE, ShmRing};
use super::samples::Samples;
use super::{SidecarArgs, SidecarError, events, handoff, http};
use crate::decode::DecodeLimits;
use crate::gpu::{self, GpuPlacement, GpuProbe};
use crate::index::ShardTable;
use crate::source::{ManifestLocation, S3Config, S3Source};
use crate::transform::Transform;

/// Where samples come from: the S3 source and the samples every plan orders.
pub(super) struct Dataset {
    pub source: S3Source,
    pub samples: Samples,
}

/// One plan per local rank served; every rank has the same number of batches per epoch.
pub(super) struct EpochPlans {
    pub plans: Vec<PlanConfig>,
    pub batches_per_epoch: u64,
}

/// The shape of every rank's ring.
pub(super) struct RingLayout {
    pub slots: usize,
    pub slot_bytes: usize,
}

/// The decode workers as discovery finds them, and the share of batches decoded here.
pub(super) struct Workers {
    pub fleet: Arc<WorkerPool>,
    /// At start: every batch when no worker source is configured, else --local-share.
    pub local_share: f64,
    /// Discovery's Kubernetes client, reused to watch the own pod's annotation.
    pub kube_client: Option<kube::Client>,
}

/// What the pipelines and `hello`s of all local ranks share (SIDECAR.md: one fleet, one local
/// pool, one metrics registry for the pod).
pub(super) struct SharedByRanks {
    pub dataset: Dataset,
    pub transform: Transform,
    pub metrics: Arc<SidecarMetrics>,
    pub gpu: GpuInfo,
    pub local_pool: Arc<rayon::ThreadPool>,
    pub workers: Workers,
    pub source_down: Arc<watch::Sender<Option<String>>>,
}

/// One trainer process served: its pipeline (which holds its ring), its `hello`, its socket.
pub(super) struct ServedRank {
    pub pipeline: Arc<Pipeline>,
    pub hello: Arc<HelloInfo>,
    pub socket: PathBuf,
}

/// The sidecar's HTTP port, bound and serving.
pub(super) struct HttpPort {
    pub addr: SocketAddr,
    /// `/readyz` passes while this is set: once every trainer socket listens.
    pub socket_listening: Arc<AtomicBool>,
}

/// Probes the driver once: `hello` tells trainers whether they may pin the ring on a GPU.
pub(super) fn probe_gpu(placement: GpuPlacement) -> GpuInfo {
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
    let placement_on = placement == GpuPlacement::Auto && probe.is_available();
    GpuInfo {
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
    }
}

/// Connects to S3 and reads what the plans order: the index's shard table, else the manifest's
/// sample list, else the listing of the prefix.
pub(super) async fn load_dataset(
    args: &SidecarArgs,
    s3: &S3Config,
    metrics: &SidecarMetrics,
) -> Result<Dataset, SidecarError> {
    let source = S3Source::connect(s3, metrics.loader.clone()).await;
    let dataset_err = |source| SidecarError::Dataset {
        bucket: args.bucket.clone(),
        prefix: args.prefix.clone(),
        source: Box::new(source),
    };
    let samples = if let Some(index) = &args.index {
        let table = ShardTable::load(&source, ManifestLocation::parse(index)).await?;
        tracing::info!(
            index = %index,
            shards = table.counts.len(),
            table_bytes = table.resident_bytes(),
            "planning over the index's shards"
        );
        Samples::sharded(table, args.shuffle_window)
    } else {
        let listed = match &args.manifest {
            Some(m) => source.load_manifest(&ManifestLocation::parse(m)).await,
            None => source.list(&args.bucket, &args.prefix, 1000).await,
        }
        .map_err(dataset_err)?;
        Samples::Listed(Arc::new(listed))
    };
    if samples.is_empty() {
        return Err(SidecarError::EmptyDataset {
            bucket: args.bucket.clone(),
            prefix: args.prefix.clone(),
        });
    }
    Ok(Dataset { source, samples })
}

/// One epoch plan per local rank over `samples`, checked, with the resume point inside an epoch.
pub(super) fn plan_epochs(args: &SidecarArgs, samples: usize) -> Result<EpochPlans, SidecarError> {
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
                rank: args.first_rank() + i,
                world_size: args.world_size,
            },
        })
        .collect();
    for plan in &plans {
        match plan.validate(samples) {
            // A pod may know its node rank but not the world size: its trainers say both when
            // they connect, and the stream starts then.
            Err(PlanError::RankOutOfRange { .. }) => {}
            other => other?,
        }
    }
    // Equal on every rank by construction of the plan.
    let batches_per_epoch = plans[0].batches_per_epoch(samples) as u64;
    if args.start_batch >= batches_per_epoch {
        return Err(SidecarError::StartBatch {
            start_batch: args.start_batch,
            batches_per_epoch,
        });
    }
    Ok(EpochPlans {
        plans,
        batches_per_epoch,
    })
}

/// Prefetched plus held batches per ring, each slot a whole batch (or --slot-bytes).
pub(super) fn ring_layout(args: &SidecarArgs, transform: &Transform) -> RingLayout {
    RingLayout {
        slots: stoker_contract::ring_slots(
            args.prefetch_batches.max(1) as u64,
            args.held_batches.max(1) as u64,
        ) as usize,
        slot_bytes: args
            .slot_bytes
            .unwrap_or_else(|| default_slot_bytes(transform, args.batch_size)),
    }
}

/// Bytes of one batch of RGB8 samples at the transform's slot size (larger samples become
/// skips unless --slot-bytes says otherwise).
fn default_slot_bytes(transform: &Transform, batch_size: usize) -> usize {
    let bytes = stoker_contract::slot_bytes(batch_size as u64, transform.slot_pixels());
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

/// Creates the memory-backed directory that holds the rings and the default sockets.
pub(super) fn create_shm_dir(dir: &Path) -> Result<(), SidecarError> {
    std::fs::create_dir_all(dir).map_err(|source| SidecarError::Bind {
        what: "shm dir",
        addr: dir.display().to_string(),
        source,
    })
}

/// Refuses to start when the rings cannot fit in the shared-memory directory: a ring file is
/// sparse, and a write past a full tmpfs kills the sidecar with SIGBUS mid-epoch.
pub(super) fn check_rings_fit(args: &SidecarArgs, layout: &RingLayout) -> Result<(), SidecarError> {
    let ranks = u64::from(args.local_ranks.max(1));
    let needed = ranks
        .saturating_mul(layout.slots as u64)
        .saturating_mul(layout.slot_bytes as u64);
    let dir = args.shm_dir.display().to_string();
    let stat = rustix::fs::statvfs(&args.shm_dir).map_err(|e| SidecarError::Bind {
        what: "shm dir",
        addr: dir.clone(),
        source: e.into(),
    })?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    if needed > free {
        return Err(SidecarError::RingsTooLarge {
            dir,
            needed,
            free,
            ranks,
            slots: layout.slots,
            slot_bytes: layout.slot_bytes,
        });
    }
    Ok(())
}

/// The threads that decode in the sidecar: --local-decoders, 0 = one per core.
pub(super) fn start_local_pool(
    local_decoders: usize,
) -> Result<Arc<rayon::ThreadPool>, SidecarError> {
    let threads = if local_decoders == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        local_decoders
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("local-decode-{i}"))
        .build()
        .map_err(|e| SidecarError::Pool {
            detail: e.to_string(),
        })?;
    Ok(Arc::new(pool))
}

/// The decode workers: found once now, then again every --discovery-interval-secs.
pub(super) async fn start_fleet(args: &SidecarArgs) -> Result<Workers, SidecarError> {
    let fleet = Arc::new(
        WorkerPool::new(FleetPolicy {
            max_failures: args.max_worker_failures.max(1),
            set_aside_for: Duration::from_secs(args.set_aside_secs),
        })
        .with_tls(crate::worker::PipelineTls::from_args(&args.tls)?),
    );
    let mut kube_client = None;
    let discovery: Option<Box<dyn WorkerDiscovery>> = match &args.workers_selector {
        Some(selector) => {
            let workers = KubeWorkers::connect(
                args.workers_namespace.clone(),
                selector.clone(),
                args.pipeline_uid.clone(),
            )
            .await?;
            kube_client = Some(workers.client.clone());
            Some(Box::new(workers))
        }
        None => workers_from_flags(args),
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
        let every = Duration::from_secs(args.discovery_interval_secs.max(1));
        tokio::spawn(rediscover(d, fleet.clone(), every));
    }
    Ok(Workers {
        fleet,
        local_share,
        kube_client,
    })
}

/// The workers named by flags: a DNS name (re-resolved) before a static list; None without.
fn workers_from_flags(args: &SidecarArgs) -> Option<Box<dyn WorkerDiscovery>> {
    if let Some(name) = &args.workers_dns {
        return Some(Box::new(DnsWorkers {
            name: name.clone(),
            port: args.workers_port,
        }));
    }
    if !args.workers.is_empty() {
        return Some(Box::new(StaticWorkers(args.workers.clone())));
    }
    None
}

/// Runs discovery every `every` for the sidecar's life, logging the workers that changed.
async fn rediscover(discovery: Box<dyn WorkerDiscovery>, fleet: Arc<WorkerPool>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        match discovery.discover().await {
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
}

/// Maps one ring per local rank and builds the pipeline that fills it and its `hello`.
pub(super) fn open_rings(
    args: &SidecarArgs,
    plans: &EpochPlans,
    layout: &RingLayout,
    shared: &SharedByRanks,
) -> Result<Vec<ServedRank>, SidecarError> {
    let mut ranks = Vec::with_capacity(plans.plans.len());
    for (i, plan) in plans.plans.iter().enumerate() {
        let local_rank = args.local_rank + i as u32;
        let ring = ShmRing::create(&args.shm_dir, local_rank, layout.slots, layout.slot_bytes)?;
        let samples = shared.dataset.samples.len();
        let hello = hello_for(
            args,
            plan,
            &ring,
            plans.batches_per_epoch,
            samples,
            &shared.gpu,
        );
        ranks.push(ServedRank {
            pipeline: pipeline_for(args, *plan, ring, shared),
            hello: Arc::new(hello),
            socket: socket_path(args, i as u32),
        });
    }
    Ok(ranks)
}

/// The pipeline of one local rank: its plan and ring, the shared decoders, the flags' limits.
fn pipeline_for(
    args: &SidecarArgs,
    plan: PlanConfig,
    ring: Arc<ShmRing>,
    shared: &SharedByRanks,
) -> Arc<Pipeline> {
    let pipeline = Arc::new(Pipeline {
        bucket: shared.dataset.samples.bucket(&args.bucket).to_string(),
        samples: shared.dataset.samples.clone(),
        plan,
        start: Cursor {
            epoch: args.start_epoch,
            position: plan.position_after(shared.dataset.samples.len(), args.start_batch),
        },
        epochs: args.epochs,
        transform: shared.transform,
        limits: DecodeLimits {
            max_pixels: args.max_source_pixels,
        },
        batch_timeout: Duration::from_secs_f64(args.batch_timeout_secs.max(0.001)),
        source_retry: Duration::from_secs(args.source_retry_secs),
        local_fallback: !args.no_local_fallback,
        local_share: AtomicU64::new(0),
        local_pool: shared.local_pool.clone(),
        source: shared.dataset.source.clone(),
        fleet: shared.workers.fleet.clone(),
        ring,
        delivery: Delivery::default(),
        busy_turns: BusyTurns::default(),
        metrics: shared.metrics.clone(),
        stream: Mutex::new(Stream::new(plan.shard)),
        source_down: shared.source_down.clone(),
    });
    pipeline.set_local_share(shared.workers.local_share);
    pipeline
}

/// What `hello` tells the trainer of one local rank: its ring, its shard, the GPU placement.
fn hello_for(
    args: &SidecarArgs,
    plan: &PlanConfig,
    ring: &ShmRing,
    batches_per_epoch: u64,
    samples: usize,
    gpu: &GpuInfo,
) -> HelloInfo {
    HelloInfo {
        shm_path: ring.path().display().to_string(),
        slots: ring.slots() as u32,
        slot_bytes: ring.slot_bytes() as u64,
        rank: plan.shard.rank,
        world_size: args.world_size,
        batch_size: args.batch_size as u32,
        batches_per_epoch,
        start_epoch: args.start_epoch,
        start_batch: args.start_batch,
        epoch: args.start_epoch,
        position: 0,
        samples: samples as u64,
        seed: args.seed,
        resize: args.transform.resize.as_str().to_string(),
        gpu: gpu.clone(),
    }
}

/// The socket of the `i`-th local rank served: --socket (one local rank only), else
/// `<shm-dir>/stoker-<local rank>.sock`.
pub(super) fn socket_path(args: &SidecarArgs, i: u32) -> PathBuf {
    match &args.socket {
        Some(s) if args.local_ranks <= 1 => s.clone(),
        _ => args
            .shm_dir
            .join(format!("stoker-{}.sock", args.local_rank + i)),
    }
}

/// With --pod-name, follows the autoscaler's local-decode share in this pod's annotation.
pub(super) fn follow_share_annotation(
    args: &SidecarArgs,
    kube_client: Option<kube::Client>,
    ranks: &[ServedRank],
) {
    let Some(pod) = args.pod_name.clone() else {
        return;
    };
    let pipelines: Vec<Arc<Pipeline>> = ranks.iter().map(|r| r.pipeline.clone()).collect();
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

/// With --pipeline, records a Warning Event on the DataPipeline while its source is down.
pub(super) fn report_source_events(
    args: &SidecarArgs,
    kube_client: Option<kube::Client>,
    source_down: &watch::Sender<Option<String>>,
) {
    let Some(name) = args.pipeline.clone() else {
        return;
    };
    let pipeline = events::EventSubject {
        name,
        namespace: args.workers_namespace.clone(),
        uid: args.pipeline_uid.clone(),
    };
    let pod = args.pod_name.clone();
    let source_down = source_down.subscribe();
    tokio::spawn(async move {
        let without = "source outages are logged, not recorded as Events";
        if let Some(client) = discovery::kube::client_or_default(kube_client, without).await {
            events::report_source_unavailable(client, pipeline, pod, source_down).await;
        }
    });
}

/// Binds and serves `/metrics`, the probes and `GET /local-share`; not ready until the sockets.
pub(super) async fn serve_http(
    addr: SocketAddr,
    ranks: &[ServedRank],
) -> Result<HttpPort, SidecarError> {
    let bind_err = |source| SidecarError::Bind {
        what: "http",
        addr: addr.to_string(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(bind_err)?;
    let bound = listener.local_addr().map_err(bind_err)?;
    let socket_listening = Arc::new(AtomicBool::new(false));
    let app = http::router(http::HttpState {
        pipelines: ranks.iter().map(|r| r.pipeline.clone()).collect(),
        socket_listening: socket_listening.clone(),
    });
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(%err, "http server stopped");
        }
    });
    Ok(HttpPort {
        addr: bound,
        socket_listening,
    })
}

/// Starts each rank's pipeline and binds its trainer socket, then marks the port ready; the
/// returned futures serve the sockets.
pub(super) fn serve_trainers(
    ranks: &[ServedRank],
    http: &HttpPort,
) -> Result<Vec<impl Future<Output = ()> + use<>>, SidecarError> {
    let mut serving = Vec::with_capacity(ranks.len());
    for rank in ranks {
        rank.pipeline.start()?;
        // A socket file left by a previous run of this sidecar would make bind fail.
        let _ = std::fs::remove_file(&rank.socket);
        let bind_err = |source| SidecarError::Bind {
            what: "unix socket",
            addr: rank.socket.display().to_string(),
            source,
        };
        let listener = tokio::net::UnixListener::bind(&rank.socket).map_err(bind_err)?;
        // The trainer may run as another user: it shares the pod's fsGroup with us.
        std::fs::set_permissions(&rank.socket, std::fs::Permissions::from_mode(SHARED_MODE))
            .map_err(bind_err)?;
        serving.push(handoff::serve(
            listener,
            rank.pipeline.clone(),
            rank.hello.clone(),
        ));
    }
    http.socket_listening.store(true, Ordering::SeqCst);
    Ok(serving)
}

/// Prints the addresses on stdout (scripts and tests wait for this line) and logs the shape.
pub(super) fn announce(
    args: &SidecarArgs,
    ranks: &[ServedRank],
    http: &HttpPort,
    plans: &EpochPlans,
    layout: &RingLayout,
) {
    let sockets: Vec<String> = ranks
        .iter()
        .map(|r| r.socket.display().to_string())
        .collect();
    let rings: Vec<String> = ranks
        .iter()
        .map(|r| r.pipeline.ring.path().display().to_string())
        .collect();
    println!(
        "stoker-loader sidecar listening socket={} http={} shm={}",
        sockets.join(","),
        http.addr,
        rings.join(","),
    );
    tracing::info!(
        rank = args.first_rank(),
        local_ranks = plans.plans.len() as u32,
        world_size = args.world_size,
        batches_per_epoch = plans.batches_per_epoch,
        slots = layout.slots,
        slot_bytes = layout.slot_bytes,
        "sidecar serving"
    );
}

/// Marks the port unready and removes the sockets and ring files.
pub(super) fn clean_up(ranks: &[ServedRank], http: &HttpPort) {
    http.socket_listening.store(false, Ordering::SeqCst);
    for rank in ranks {
        let _ = std::fs::remove_file(&rank.socket);
        // Tasks still hold the ring, so its Drop may never run before exit: remove the file here.
        let _ = std::fs::remove_file(rank.pipeline.ring.path());
    }
}
