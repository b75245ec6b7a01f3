//! Where samples come from: S3 listing (ListObjectsV2, paginated), JSONL manifests (in S3 or on
//! disk), WebDataset tar shards and Parquet files (byte ranges from the dataset index, fetched
//! with coalesced range GETs), and GETs with bounded concurrency and jittered exponential backoff.

mod manifest;
mod members;
pub mod parquet;
mod s3;
pub mod tar;

pub use manifest::{ManifestLocation, parse_manifest};
pub use members::{CoalescePolicy, fetch_samples};
pub use s3::{RetryPolicy, S3Config, S3Source, StaticCredentials};

use crate::decode::SkipReason;

/// One sample of a dataset: its object key and the free metadata that travels with it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SampleRef {
    pub key: String,
    /// JSON object with the manifest's other fields (caption, label, ...); empty when listed.
    pub metadata: String,
    /// The sample's bytes inside `key` (a WebDataset shard: its members back to back);
    /// `None`: the whole object is the image.
    pub range: Option<std::ops::Range<u64>>,
    /// A Parquet row: `range` is its data page, and this says which row of it and how the
    /// page is encoded.
    pub parquet: Option<parquet::ParquetValue>,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("s3://{bucket}/{key} not found")]
    NotFound { bucket: String, key: String },
    #[error("s3://{bucket}/{key}: still throttled (503 SlowDown) after {attempts} attempts")]
    Throttled {
        bucket: String,
        key: String,
        attempts: u32,
    },
    #[error("s3://{bucket}/{key}: server error {status} after {attempts} attempts")]
    Server {
        bucket: String,
        key: String,
        status: u16,
        attempts: u32,
    },
    #[error("s3://{bucket}/{key}: {range} starts past the object's end (truncated shard?)")]
    RangeNotSatisfiable {
        bucket: String,
        key: String,
        range: String,
    },
    #[error(
        "s3://{bucket}/{key}: {bytes} bytes, more than a sample may have ({limit}, --max-object-bytes)"
    )]
    TooLarge {
        bucket: String,
        key: String,
        bytes: u64,
        limit: u64,
    },
    #[error("s3://{bucket}/{key}: access refused or no such bucket (HTTP {status})")]
    AccessDenied {
        bucket: String,
        key: String,
        status: u16,
    },
    #[error(
        "s3://{bucket}/{key}: timed out or connection failed after {attempts} attempts: {detail}"
    )]
    Transport {
        bucket: String,
        key: String,
        attempts: u32,
        detail: String,
    },
    #[error("s3://{bucket}/{key}: request failed: {detail}")]
    Request {
        bucket: String,
        key: String,
        detail: String,
    },
    #[error("manifest {location}, line {line}: {detail}")]
    Manifest {
        location: String,
        line: usize,
        detail: String,
    },
    #[error("reading manifest {location}: {detail}")]
    ManifestRead { location: String, detail: String },
}

impl SourceError {
    /// Error label on metrics.
    pub fn category(&self) -> &'static str {
        match self {
            SourceError::NotFound { .. } => "not_found",
            SourceError::RangeNotSatisfiable { .. } => "range_not_satisfiable",
            SourceError::Throttled { .. } => "throttled",
            SourceError::Server { .. } => "server_error",
            SourceError::TooLarge { .. } => "too_large",
            SourceError::AccessDenied { .. } => "access_denied",
            SourceError::Transport { .. } => "transport",
            SourceError::Request { .. } => "request",
            SourceError::Manifest { .. } => "manifest",
            SourceError::ManifestRead { .. } => "manifest_read",
        }
    }

    /// How a sample that hit this error is reported in a batch: a missing object is the
    /// sample's problem; refused access is the source's (no retry helps); the rest is
    /// transient and worth another try later.
    pub fn skip_reason(&self) -> SkipReason {
        match self {
            SourceError::NotFound { .. } => SkipReason::NotFound,
            SourceError::RangeNotSatisfiable { .. } => SkipReason::Truncated,
            SourceError::TooLarge { .. } => SkipReason::TooLarge,
            SourceError::AccessDenied { .. } => SkipReason::SourceUnavailable,
            _ => SkipReason::S3Error,
        }
    }
}
