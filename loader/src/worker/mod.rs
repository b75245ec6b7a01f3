//! The decode worker (`stoker-loader decode`): a tonic gRPC service that fetches, decodes and
//! transforms one batch per call on a pool sized to the cores, behind a bounded admission queue,
//! with /metrics, /healthz and /readyz over HTTP and a SIGTERM drain.

mod client;
mod convert;
mod server;
mod service;

pub use client::{DecodeClient, MAX_MESSAGE_BYTES};
pub use convert::{batch_from_reply, transform_from_proto, transform_to_proto};
pub use server::{DecodeServer, WorkerConfig};
pub use service::{DecodeWorker, WorkerState};
