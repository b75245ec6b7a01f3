//! The decode worker (`stoker-loader decode`): a tonic gRPC service that fetches, decodes and
//! transforms one batch per call on a pool sized to the container's CPUs, behind a bounded
//! admission queue, for its pipeline's bucket and prefix only, with /metrics, /healthz and
//! /readyz over HTTP and a SIGTERM drain. Its memory stays within
//! [`stoker_contract::DecodeArgs::memory_bound`].

mod client;
mod convert;
mod gate;
mod limits;
mod scope;
mod server;
mod service;
mod tls;

pub use client::{DecodeClient, MAX_MESSAGE_BYTES};
pub use convert::{batch_from_reply, encode_reply, transform_from_proto, transform_to_proto};
pub use limits::{CGROUP_CPU_MAX, cgroup_cpus, decode_threads, max_output_pixels};
pub use scope::{ScopeViolation, SourceScope};
pub use server::{DecodeServer, WorkerConfig};
pub use service::{DecodeWorker, WorkerState};
pub use tls::{Incoming, PeerStream, PipelineTls, TlsChannelConnector, TlsError};
