//! A reusable client for decode workers, with message limits and HTTP/2 windows sized for
//! multi-megabyte batches (a 32 x 448² batch is 19 MB; tonic's default limit is 4 MiB).

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::proto;
use crate::proto::decode_service_client::DecodeServiceClient;

/// Largest message either side accepts: 256 x 448² x 3 with room to spare.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Stream and connection windows: a whole batch fits in flight without waiting for updates.
pub(crate) const STREAM_WINDOW: u32 = 32 << 20;
pub(crate) const CONNECTION_WINDOW: u32 = 128 << 20;
pub(crate) const MAX_FRAME: u32 = 1 << 20;

#[derive(Clone, Debug)]
pub struct DecodeClient {
    inner: DecodeServiceClient<Channel>,
}

impl DecodeClient {
    /// Connects to `http://host:port`.
    pub async fn connect(endpoint: impl Into<String>) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(endpoint.into())?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            // Lets the worker send 1 MiB DATA frames instead of 16 KiB ones: a 19 MB batch
            // becomes 19 frames, not 1,200.
            .max_frame_size(MAX_FRAME)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .connect()
            .await?;
        Ok(Self::from_channel(channel))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: DecodeServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }

    pub async fn decode_batch(
        &mut self,
        request: proto::DecodeBatchRequest,
    ) -> Result<proto::DecodeBatchReply, tonic::Status> {
        Ok(self.inner.decode_batch(request).await?.into_inner())
    }
}
