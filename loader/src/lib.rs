//! stoker-loader: stoker's data plane.
//!
//! The decode engine is a library so that the decode worker, the trainer sidecar and the
//! profiler share one path: [`source`] fetches encoded bytes from S3, [`batch::decode_batch`]
//! decodes ([`decode`]) and resizes ([`transform`]) one batch into packed uint8 HWC pixels,
//! [`worker`] serves that over gRPC and provides the client, [`metrics`] counts it all.

pub mod batch;
pub mod decode;
pub mod gpu;
pub mod index;
pub mod metrics;
pub mod profile;
pub mod proto;
pub mod retry;
pub mod sidecar;
pub mod source;
pub mod transform;
pub mod worker;

pub use batch::{Batch, DecodedInto, EncodedSample, SampleMeta, decode_batch, decode_batch_into};
pub use transform::Transform;
