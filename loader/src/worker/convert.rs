//! Mapping between the engine's types and the wire types.

use clap::ValueEnum;
use stoker_contract::{ResizeMode, TransformArgs};

use bytes::BytesMut;
use prost::Message;

use crate::batch::{Batch, BatchTimings, PooledBatch, SampleMeta};
use crate::decode::SkipReason;
use crate::proto;
use crate::transform::{Transform, TransformError};

pub fn transform_from_proto(t: Option<&proto::Transform>) -> Result<Transform, TransformError> {
    let t = t.ok_or_else(|| TransformError::InvalidSettings {
        detail: "missing transform".into(),
    })?;
    let resize =
        ResizeMode::from_str(&t.resize, false).map_err(|_| TransformError::InvalidSettings {
            detail: format!("unknown resize mode {:?}", t.resize),
        })?;
    Transform::from_args(&TransformArgs {
        resize,
        width: t.width,
        height: t.height,
        pad: u8::try_from(t.pad_value).unwrap_or(u8::MAX),
        factor: t.factor,
        min_pixels: t.min_pixels,
        max_pixels: t.max_pixels,
    })
}

pub fn transform_to_proto(t: &Transform) -> proto::Transform {
    let args = t.to_args();
    proto::Transform {
        resize: t.name().to_string(),
        width: args.width,
        height: args.height,
        pad_value: args.pad.into(),
        factor: args.factor,
        min_pixels: args.min_pixels,
        max_pixels: args.max_pixels,
    }
}

pub(crate) fn meta_to_proto(m: SampleMeta) -> proto::SampleMeta {
    proto::SampleMeta {
        key: m.key,
        metadata: m.metadata,
        orig_width: m.orig_width,
        orig_height: m.orig_height,
        height: m.height,
        width: m.width,
        offset: m.offset,
        encoded_bytes: m.encoded_bytes,
        skip_reason: m.skip.map(|r| r.as_str().to_string()).unwrap_or_default(),
    }
}

/// A decoded batch as the protobuf message a worker sends, encoded: what tonic does with a
/// reply before HTTP/2 framing (the pixels are copied once, into the message). `profile` times
/// it as the reply stage.
pub fn encode_reply(batch_id: u64, batch: PooledBatch) -> bytes::Bytes {
    let reply = proto::DecodeBatchReply {
        batch_id,
        pixels: batch.pixels,
        samples: batch.samples.into_iter().map(meta_to_proto).collect(),
        timings: None,
    };
    let mut buf = BytesMut::with_capacity(reply.encoded_len());
    // Cannot fail: the buffer holds `encoded_len` bytes.
    let _ = reply.encode(&mut buf);
    buf.freeze()
}

/// Turns a reply back into a [`Batch`] (the sidecar's view); the pixel buffer is copied once out
/// of the reply's `Bytes` only when it is shared.
pub fn batch_from_reply(reply: proto::DecodeBatchReply) -> Batch {
    let samples = reply
        .samples
        .into_iter()
        .map(|m| SampleMeta {
            key: m.key,
            metadata: m.metadata,
            orig_width: m.orig_width,
            orig_height: m.orig_height,
            width: m.width,
            height: m.height,
            offset: m.offset,
            encoded_bytes: m.encoded_bytes,
            skip: if m.skip_reason.is_empty() {
                None
            } else {
                Some(SkipReason::parse(&m.skip_reason).unwrap_or(SkipReason::Corrupt))
            },
        })
        .collect();
    Batch {
        pixels: Vec::from(reply.pixels),
        samples,
        timings: BatchTimings::default(),
    }
}
