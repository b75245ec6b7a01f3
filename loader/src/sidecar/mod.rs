//! `stoker-loader sidecar`: runs next to the trainer. It owns the epoch order of its rank
//! ([`plan`]), keeps a bounded number of batches in flight across the decode workers
//! ([`fleet`], [`discovery`]), re-sends a batch whose worker failed, decodes locally when no
//! worker is reachable or when told to, and hands batches to the trainer through a
//! shared-memory ring ([`ring`]) and a unix socket ([`handoff`], [`protocol`]).

pub mod client;
pub mod discovery;
pub mod events;
pub mod fleet;
pub mod handoff;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod plan;
pub mod protocol;
pub mod ring;
pub mod samples;
mod stages;

use std::sync::Arc;

use crate::source::{S3Config, SourceError};
use crate::transform::Transform;
use metrics::SidecarMetrics;
use plan::PlanError;
use ring::RingError;

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("loading the dataset of s3://{bucket}/{prefix}: {source}")]
    Dataset {
        bucket: String,
        prefix: String,
        // Boxed: the largest variant sets the size of every `Result` the stages return.
        #[source]
        source: Box<SourceError>,
    },
    #[error("the dataset s3://{bucket}/{prefix} has no samples")]
    EmptyDataset { bucket: String, prefix: String },
    #[error("loading the dataset index: {0}")]
    Index(#[from] crate::index::IndexError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error(transparent)]
    Tls(#[from] crate::worker::TlsError),
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
    #[error(
        "the rings need {needed} bytes ({ranks} rank(s) × {slots} slots × {slot_bytes} bytes) but {dir} has {free} bytes free: raise the DataPipeline's trainer.sharedMemory or lower trainer.prefetchBatches"
    )]
    RingsTooLarge {
        dir: String,
        needed: u64,
        free: u64,
        ranks: u64,
        slots: usize,
        slot_bytes: usize,
    },
}

impl SidecarError {
    pub fn category(&self) -> &'static str {
        match self {
            SidecarError::Dataset { .. } => "dataset",
            SidecarError::EmptyDataset { .. } => "empty_dataset",
            SidecarError::Index(e) => e.category(),
            SidecarError::Plan(e) => e.category(),
            SidecarError::Ring(e) => e.category(),
            SidecarError::Discovery(e) => e.category(),
            SidecarError::Tls(e) => e.category(),
            SidecarError::Bind { .. } => "bind",
            SidecarError::Pool { .. } => "pool",
            SidecarError::StartBatch { .. } => "start_batch",
            SidecarError::SocketWithLocalRanks { .. } => "socket_with_local_ranks",
            SidecarError::RingsTooLarge { .. } => "rings_too_large",
        }
    }
}

/// Flags of `stoker-loader sidecar`: the contract the operator renders them from.
pub use stoker_contract::SidecarArgs;

/// A running sidecar: addresses known, serving until the shutdown future resolves.
pub async fn run(
    args: SidecarArgs,
    s3: S3Config,
    transform: Transform,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), SidecarError> {
    let gpu = stages::probe_gpu(args.gpu_placement);
    let metrics = Arc::new(SidecarMetrics::new());
    let dataset = stages::load_dataset(&args, &s3, &metrics).await?;
    let plans = stages::plan_epochs(&args, dataset.samples.len())?;
    let layout = stages::ring_layout(&args, &transform);
    stages::create_shm_dir(&args.shm_dir)?;
    stages::check_rings_fit(&args, &layout)?;
    let local_pool = stages::start_local_pool(args.local_decoders)?;
    let mut workers = stages::start_fleet(&args).await?;
    let kube_client = workers.kube_client.take();
    let shared = stages::SharedByRanks {
        dataset,
        transform,
        metrics,
        gpu,
        local_pool,
        workers,
        source_down: Arc::new(tokio::sync::watch::Sender::new(None)),
    };
    let ranks = stages::open_rings(&args, &plans, &layout, &shared)?;
    stages::report_source_events(&args, kube_client.clone(), &shared.source_down);
    stages::follow_share_annotation(&args, kube_client, &ranks);
    let http = stages::serve_http(args.http_addr, &ranks).await?;
    let serving = stages::serve_trainers(&ranks, &http)?;
    stages::announce(&args, &ranks, &http, &plans, &layout);
    tokio::select! {
        _ = futures::future::join_all(serving) => {}
        () = shutdown => tracing::info!("sidecar stopping"),
    }
    stages::clean_up(&ranks, &http);
    Ok(())
}
