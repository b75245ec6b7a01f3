//! The hand-off protocol on the unix socket: one JSON object per line each way.
//!
//! Trainer → sidecar: `{"op":"hello","rank":R,"world_size":W}` (both optional),
//! `{"op":"next","timeout_ms":N}`, `{"op":"release","slot":S}` (no answer),
//! `{"op":"seek","epoch":E,"position":P,"seed":S,"batch_size":B,"samples":N}`.
//! Sidecar → trainer: `hello`, `batch`, `end_of_epoch`, `done`, `timeout`, `seeked`,
//! `source_unavailable`, `error`
//! (see [`Reply`]). Pixels never cross the socket: a `batch` names the slot of the ring that
//! holds them.
//!
//! A resume point is (epoch, position): the samples of the epoch's order that all ranks
//! together have consumed (see [`super::plan`]). Every `batch` carries the position after it,
//! so the trainer's checkpoint holds the last one it trained on, and `seek` restarts the
//! stream there, over the world size the trainer said in `hello`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The trainer's rank and world size (torchrun's `RANK`, `WORLD_SIZE`), when it knows them:
    /// they replace the sidecar's own for this socket's stream.
    Hello {
        #[serde(default)]
        rank: Option<u32>,
        #[serde(default)]
        world_size: Option<u32>,
    },
    /// Restart the stream at a checkpoint's resume point. Seed, batch size and sample count
    /// must be the sidecar's: a checkpoint of another order cannot resume this one.
    Seek {
        epoch: u64,
        position: u64,
        seed: u64,
        batch_size: u32,
        samples: u64,
    },
    Next {
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    Release {
        slot: u32,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SampleHeader {
    pub key: String,
    /// Manifest metadata as the JSON text it was given (empty when listed).
    pub metadata: String,
    /// [height, width, 3]; [0, 0, 3] when skipped.
    pub shape: [u32; 3],
    /// Byte offset of the sample's pixels from the start of the slot.
    pub offset: u64,
    /// Skip reason (corrupt, truncated, not_found, ...) or null.
    pub skip: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BatchHeader {
    pub slot: u32,
    /// Byte offset of the slot in the ring file.
    pub slot_offset: u64,
    /// Pixel bytes used in the slot.
    pub nbytes: u64,
    pub epoch: u64,
    /// Position in this rank's epoch (0-based).
    pub index: u64,
    /// epoch x batches_per_epoch + index: a step counter stable across restarts.
    pub batch_id: u64,
    /// The epoch's position once every rank has consumed this batch: the resume point of a
    /// checkpoint taken after it.
    pub position: u64,
    pub dtype: String,
    pub samples: Vec<SampleHeader>,
    /// CLOCK_MONOTONIC nanoseconds when the batch was ready in the slot.
    pub ready_ns: u64,
    /// remote or local.
    pub route: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuInfo {
    pub available: bool,
    /// Why not, when unavailable.
    pub reason: Option<String>,
    pub devices: u32,
    /// What the trainer should do: `pinned_ring` (register the ring with cudaHostRegister and
    /// copy with non_blocking) or `off`.
    pub placement: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HelloInfo {
    pub shm_path: String,
    pub slots: u32,
    pub slot_bytes: u64,
    pub rank: u32,
    pub world_size: u32,
    pub batch_size: u32,
    pub batches_per_epoch: u64,
    pub start_epoch: u64,
    pub start_batch: u64,
    /// Where the stream stands: the next batch is from this epoch, after this position.
    pub epoch: u64,
    pub position: u64,
    /// Samples in the dataset, and the shuffle seed: a checkpoint names both.
    pub samples: u64,
    pub seed: u64,
    /// crop, fit or qwenSmart (samples of different shapes).
    pub resize: String,
    pub gpu: GpuInfo,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    Hello(HelloInfo),
    Batch(BatchHeader),
    EndOfEpoch {
        epoch: u64,
    },
    /// The configured number of epochs is over.
    Done,
    /// The stream restarted at the resume point; `batches` are left in that epoch for this rank.
    Seeked {
        epoch: u64,
        position: u64,
        batches: u64,
    },
    /// The source refuses the samples (access, a missing bucket) or kept failing past the
    /// retry budget: delivery stopped here; a `seek` tries again.
    SourceUnavailable {
        message: String,
    },
    /// Nothing became ready within the request's timeout.
    Timeout,
    Error {
        message: String,
    },
}

/// CLOCK_MONOTONIC in nanoseconds: the same clock as Python's `time.monotonic_ns()`, so the
/// trainer can measure hand-off latency against `ready_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; CLOCK_MONOTONIC always exists on Linux.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_is_tagged_json() {
        let r: Request = serde_json::from_str(r#"{"op":"next","timeout_ms":5}"#).unwrap();
        assert_eq!(
            r,
            Request::Next {
                timeout_ms: Some(5)
            }
        );
        let r: Request = serde_json::from_str(r#"{"op":"next"}"#).unwrap();
        assert_eq!(r, Request::Next { timeout_ms: None });
        let r: Request = serde_json::from_str(r#"{"op":"hello"}"#).unwrap();
        assert_eq!(
            r,
            Request::Hello {
                rank: None,
                world_size: None
            }
        );
        let r: Request = serde_json::from_str(
            r#"{"op":"seek","epoch":1,"position":48,"seed":7,"batch_size":4,"samples":144}"#,
        )
        .unwrap();
        assert!(matches!(r, Request::Seek { position: 48, .. }));
        let text = serde_json::to_string(&Reply::EndOfEpoch { epoch: 2 }).unwrap();
        assert_eq!(text, r#"{"type":"end_of_epoch","epoch":2}"#);
    }
}
