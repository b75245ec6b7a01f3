//! The one contract between `stoker-operator` and `stoker-loader`: the labels and annotations
//! both read, the ports and paths both assume, and the loader's command lines as typed structs.
//! The operator builds [`DecodeArgs`] and [`SidecarArgs`] and renders them with
//! [`LoaderCommand::command_line`]; the loader parses the very same structs with clap. A
//! round-trip test (`tests/round_trip.rs`) holds the two ends together.

mod args;
mod render;

pub use args::{
    DecodeArgs, GpuPlacement, IndexArgs, IndexFiles, ResizeMode, S3Args, SidecarArgs, TlsArgs,
    TransformArgs,
};
pub use render::{LoaderCommand, RenderError};

/// API group of stoker's resources.
pub const GROUP: &str = "stoker.dev";
/// Names the pipeline an object belongs to; on a trainer pod it is the opt-in.
pub const LABEL_PIPELINE: &str = "stoker.dev/pipeline";
/// `decoder` or `trainer`.
pub const LABEL_ROLE: &str = "stoker.dev/role";
/// `true` once a decoder is out of discovery and waiting to be deleted.
pub const LABEL_DRAINING: &str = "stoker.dev/draining";
/// Hash of the inputs a decoder pod was built from.
pub const LABEL_TEMPLATE_HASH: &str = "stoker.dev/template-hash";
/// When a decoder's drain began (RFC 3339).
pub const ANNOTATION_DRAIN_STARTED: &str = "stoker.dev/drain-started";
/// Set by the webhook on the trainer pods it mutated.
pub const ANNOTATION_INJECTED: &str = "stoker.dev/injected";
/// A trainer pod's rank, when the training framework sets it as a label or annotation.
pub const ANNOTATION_RANK: &str = "stoker.dev/rank";
/// The world size a trainer pod declares.
pub const ANNOTATION_WORLD_SIZE: &str = "stoker.dev/world-size";
/// Trainer processes in a trainer pod (torchrun's `--nproc-per-node`), when the pod's own
/// environment, command or GPU limit does not say.
pub const ANNOTATION_LOCAL_RANKS: &str = "stoker.dev/local-ranks";
/// On a trainer pod: the share of batches (0..=1) its sidecar decodes itself, set by the
/// autoscaler when the trainer node's NIC is the bottleneck; the sidecar watches its own pod.
pub const ANNOTATION_LOCAL_SHARE: &str = "stoker.dev/local-share";
pub const ROLE_DECODER: &str = "decoder";
pub const ROLE_TRAINER: &str = "trainer";

/// gRPC port of a decoder.
pub const DECODER_GRPC_PORT: u16 = 50051;
/// Metrics and readiness port of a decoder.
pub const DECODER_METRICS_PORT: u16 = 9090;
/// The sidecar's metrics and readiness port; `/readyz` passes once its sockets listen.
pub const SIDECAR_HEALTH_PORT: u16 = 9091;

/// Where the shared-memory ring lives, in the sidecar and in every trainer container.
pub const SHM_DIR: &str = "/dev/shm/stoker";

/// Batches a trainer may hold while the sidecar fills others: a ring has
/// `prefetchBatches + HELD_BATCHES` slots.
pub const HELD_BATCHES: u64 = 2;

/// Samples in the shard-aware shuffle's buffer by default: WebDataset's usual shuffle size.
/// At 8 bytes a sample it costs a sidecar 80 KB per rank.
pub const DEFAULT_SHUFFLE_WINDOW: usize = 10_000;

/// Most bytes one sample's object (or byte range) may have by default: a training image's
/// file is a few MB; a larger one is skipped as `too_large` before its body is read.
pub const DEFAULT_MAX_OBJECT_BYTES: u64 = 64 << 20;

/// Bytes of one RGB8 pixel.
pub const RGB_BYTES: u64 = 3;

/// Bytes of one slot: a batch of RGB8 samples of at most `sample_pixels` each.
pub fn slot_bytes(batch_size: u64, sample_pixels: u64) -> u64 {
    batch_size
        .saturating_mul(sample_pixels)
        .saturating_mul(RGB_BYTES)
}

/// Slots of one rank's ring: the prefetched batches and those the trainer holds.
pub fn ring_slots(prefetch_batches: u64, held_batches: u64) -> u64 {
    prefetch_batches.saturating_add(held_batches)
}

/// Bytes of one rank's ring. The CRD's shared-memory rule says the same in CEL
/// ([`ring_bytes_cel`]), and the sidecar refuses to start when its rings do not fit.
pub fn ring_bytes(prefetch_batches: u64, batch_size: u64, sample_pixels: u64) -> u64 {
    ring_slots(prefetch_batches, HELD_BATCHES).saturating_mul(slot_bytes(batch_size, sample_pixels))
}

/// [`ring_bytes`] as a CEL expression (a double) of the CEL expressions of its inputs. In
/// doubles: CEL's integers overflow where the Rust saturates.
pub fn ring_bytes_cel(prefetch_batches: &str, batch_size: &str, sample_pixels: &str) -> String {
    format!(
        "double(({prefetch_batches} + {HELD_BATCHES}) * {batch_size} * {RGB_BYTES}) * double({sample_pixels})"
    )
}

/// Samples a decoder accepts in one `DecodeBatch` request; a sidecar sends a whole batch in one.
pub const MAX_BATCH_SAMPLES: u64 = 1024;

/// Largest width x height of one output sample in any resize mode: bounds a decoder's memory
/// per sample whatever a request asks for.
pub const MAX_OUTPUT_PIXELS: u64 = 16384 * 28 * 28;

/// Largest gRPC message either end of the decode RPC accepts (256 x 448² x 3 with room to spare).
pub const MAX_GRPC_MESSAGE_BYTES: u64 = 256 << 20;

/// Pixel bytes one batch may carry: a batch travels in one reply, and the message limit keeps
/// 16 MiB for the per-sample keys and metadata next to the pixels.
pub const MAX_BATCH_PIXEL_BYTES: u64 = MAX_GRPC_MESSAGE_BYTES - (16 << 20);

/// Where decoders and sidecars mount their pipeline's TLS Secret.
pub const TLS_DIR: &str = "/etc/stoker/tls";
/// Keys of a pipeline's TLS Secret, and the file names under [`TLS_DIR`]: the installation's
/// CA, and the pipeline's certificate (server and client) and its key.
pub const TLS_CA_FILE: &str = "ca.crt";
pub const TLS_CERT_FILE: &str = "tls.crt";
pub const TLS_KEY_FILE: &str = "tls.key";

/// The name a pipeline's certificate carries and its peers check: the DNS name of its decoder
/// Service. Service and namespace names are DNS labels, so no two pipelines share it.
pub fn pipeline_tls_name(decoder_service: &str, namespace: &str) -> String {
    format!("{decoder_service}.{namespace}.svc")
}

/// Environment the webhook gives the sidecar and the trainer containers.
pub mod env {
    /// One socket for a one-process trainer outside a pod (the sidecar's `--socket`, the
    /// client's override); pods use `$STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock` instead.
    pub const SOCKET: &str = "STOKER_SOCKET";
    /// The ring's directory (trainer containers and sidecar).
    pub const SHM_DIR: &str = "STOKER_SHM_DIR";
    /// The pipeline's name (trainer containers and decoders).
    pub const PIPELINE: &str = "STOKER_PIPELINE";
    /// The pipeline's uid (sidecar), for the Events it records on the DataPipeline.
    pub const PIPELINE_UID: &str = "STOKER_PIPELINE_UID";
    /// The sidecar's own pod, whose local-share annotation it follows.
    pub const POD_NAME: &str = "STOKER_POD_NAME";
    /// The node the sidecar runs on.
    pub const NODE_NAME: &str = "STOKER_NODE_NAME";
    /// Trainer processes the sidecar serves, one socket and ring each.
    pub const LOCAL_RANKS: &str = "STOKER_LOCAL_RANKS";
    /// The pod's place among the job's pods (torchrun's `--node-rank`).
    pub const NODE_RANK: &str = "STOKER_NODE_RANK";
}

/// The label selector sidecars use to discover a pipeline's serving decoders.
pub fn decoder_discovery_selector(pipeline: &str) -> String {
    format!("{LABEL_PIPELINE}={pipeline},{LABEL_ROLE}={ROLE_DECODER},{LABEL_DRAINING}=false")
}
