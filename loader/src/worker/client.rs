//! A reusable client for decode workers, with message limits and HTTP/2 windows sized for
//! multi-megabyte batches (a 32 x 448² batch is 19 MB; tonic's default limit is 4 MiB).

use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use super::tls::{PipelineTls, TlsChannelConnector};
use crate::proto;
use crate::proto::decode_service_client::DecodeServiceClient;

/// Largest reply a client accepts (the contract's gRPC message limit).
pub const MAX_MESSAGE_BYTES: usize = stoker_contract::MAX_GRPC_MESSAGE_BYTES as usize;
/// Largest request a client sends: what a decoder reads, so that an oversized batch fails
/// here, before it travels.
pub const MAX_REQUEST_BYTES: usize = stoker_contract::DecodeArgs::MAX_REQUEST_BYTES as usize;

/// Stream and connection windows of clients: a whole reply fits in flight without waiting for
/// updates.
pub(crate) const STREAM_WINDOW: u32 = 32 << 20;
pub(crate) const CONNECTION_WINDOW: u32 = 128 << 20;
pub(crate) const MAX_FRAME: u32 = 1 << 20;

#[derive(Clone, Debug)]
pub struct DecodeClient {
    inner: DecodeServiceClient<Channel>,
}

impl DecodeClient {
    /// Connects to `http://host:port` in plaintext.
    pub async fn connect(endpoint: impl Into<String>) -> Result<Self, tonic::transport::Error> {
        let channel = endpoint_of(endpoint.into())?.connect().await?;
        Ok(Self::from_channel(channel))
    }

    /// Connects to `http://host:port` with `tls` when given: the decoder must present this
    /// pipeline's certificate, and this client presents it too. Every reconnect reads the
    /// certificate files again, so a rotated certificate needs no new client.
    pub async fn connect_with(
        endpoint: impl Into<String>,
        tls: Option<Arc<PipelineTls>>,
    ) -> Result<Self, tonic::transport::Error> {
        let Some(tls) = tls else {
            return Self::connect(endpoint).await;
        };
        let channel = endpoint_of(endpoint.into())?
            .connect_with_connector(TlsChannelConnector { tls })
            .await?;
        Ok(Self::from_channel(channel))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: DecodeServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_REQUEST_BYTES),
        }
    }

    pub async fn decode_batch(
        &mut self,
        request: proto::DecodeBatchRequest,
    ) -> Result<proto::DecodeBatchReply, tonic::Status> {
        // tonic's own encoding limit resets the stream ("h2 protocol error"); this says why.
        let len = prost::Message::encoded_len(&request);
        if len > MAX_REQUEST_BYTES {
            return Err(tonic::Status::out_of_range(format!(
                "a DecodeBatch request of {len} bytes exceeds the decoders' limit of {MAX_REQUEST_BYTES} (DecodeArgs::MAX_REQUEST_BYTES): fewer samples or less metadata per batch"
            )));
        }
        Ok(self.inner.decode_batch(request).await?.into_inner())
    }
}

/// The decoders' endpoint settings: windows and frames sized for multi-megabyte replies.
fn endpoint_of(endpoint: String) -> Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::from_shared(endpoint)?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        // Lets the worker send 1 MiB DATA frames instead of 16 KiB ones: a 19 MB batch
        // becomes 19 frames, not 1,200.
        .max_frame_size(MAX_FRAME)
        .http2_keep_alive_interval(Duration::from_secs(30)))
}
