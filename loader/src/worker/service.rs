//! The DecodeBatch handler: admission (bounded queue), GETs, then the CPU work on the pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use futures::future::join_all;
use tokio::sync::{Semaphore, oneshot};
use tonic::{Request, Response, Status};

use super::convert::{meta_to_proto, transform_from_proto};
use super::limits::reply_pixel_bytes;
use super::scope::SourceScope;
use crate::batch::{EncodedSample, PixelPool, decode_batch_pooled};
use crate::decode::DecodeLimits;
use crate::metrics::LoaderMetrics;
use crate::proto;
use crate::proto::decode_service_server::DecodeService;
use crate::source::S3Source;

/// Shared by the service, the HTTP endpoints and the drain logic.
pub struct WorkerState {
    draining: AtomicBool,
    inflight: AtomicUsize,
    pub metrics: Arc<LoaderMetrics>,
}

impl WorkerState {
    pub fn new(metrics: Arc<LoaderMetrics>) -> Self {
        Self {
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            metrics,
        }
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }
}

/// Counts a batch as in flight for as long as it lives, whatever way the handler exits.
struct InflightGuard {
    state: Arc<WorkerState>,
    samples: i64,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.state.inflight.fetch_sub(1, Ordering::SeqCst);
        self.state.metrics.inflight_batches.dec();
        self.state.metrics.inflight_samples.dec_by(self.samples);
    }
}

pub struct DecodeWorker {
    state: Arc<WorkerState>,
    source: Option<S3Source>,
    pool: Arc<rayon::ThreadPool>,
    queue: Arc<Semaphore>,
    limits: DecodeLimits,
    max_batch_samples: usize,
    scope: Option<SourceScope>,
    /// Reply buffers, one per admitted batch at most: reused, never zeroed again.
    pixels: Arc<PixelPool>,
}

impl DecodeWorker {
    pub fn new(
        state: Arc<WorkerState>,
        source: Option<S3Source>,
        pool: Arc<rayon::ThreadPool>,
        queue_depth: usize,
        limits: DecodeLimits,
        max_batch_samples: usize,
    ) -> Self {
        state
            .metrics
            .pool_threads
            .set(pool.current_num_threads() as i64);
        Self {
            state,
            source,
            pool,
            queue: Arc::new(Semaphore::new(queue_depth.max(1))),
            limits,
            max_batch_samples,
            scope: None,
            pixels: PixelPool::new(queue_depth.max(1)),
        }
    }

    /// Serves only `scope`'s bucket and prefix; `None` serves any.
    pub fn with_scope(mut self, scope: Option<SourceScope>) -> Self {
        self.scope = scope;
        self
    }

    /// Everything checked before a batch takes a place in the queue: no GET, no allocation
    /// for a request that will be refused.
    fn check(
        &self,
        req: &proto::DecodeBatchRequest,
        peer: Option<std::net::SocketAddr>,
    ) -> Result<crate::transform::Transform, Status> {
        let metrics = &self.state.metrics;
        if let Some(scope) = &self.scope
            && let Err(violation) = scope.check(req)
        {
            metrics.reject(violation.category());
            // Names and keys only: credentials never reach a request or this line.
            tracing::warn!(
                peer = ?peer,
                reason = violation.category(),
                batch_id = req.batch_id,
                "refused: {violation}"
            );
            return Err(Status::permission_denied(format!(
                "{violation}; this decoder serves s3://{}/{}",
                scope.bucket, scope.prefix
            )));
        }
        if req.samples.len() > self.max_batch_samples {
            metrics.reject("too_many_samples");
            return Err(Status::invalid_argument(format!(
                "{} samples in one batch; the limit is {}",
                req.samples.len(),
                self.max_batch_samples
            )));
        }
        let transform = transform_from_proto(req.transform.as_ref()).map_err(|e| {
            metrics.reject("invalid_transform");
            Status::invalid_argument(e.to_string())
        })?;
        if let Err(bytes) = reply_pixel_bytes(req.samples.len(), &transform) {
            metrics.reject("reply_too_large");
            return Err(Status::resource_exhausted(format!(
                "{} samples of up to {} pixels need up to {bytes} bytes of pixels; one reply carries at most {} (MAX_BATCH_PIXEL_BYTES, within the {} byte gRPC message limit): send smaller batches",
                req.samples.len(),
                super::limits::max_output_pixels(&transform),
                stoker_contract::MAX_BATCH_PIXEL_BYTES,
                stoker_contract::MAX_GRPC_MESSAGE_BYTES,
            )));
        }
        Ok(transform)
    }

    async fn fetch(&self, bucket: &str, s: proto::SampleRef) -> EncodedSample {
        let data = if !s.inline.is_empty() {
            self.state.metrics.bytes_in.inc_by(s.inline.len() as u64);
            Ok(s.inline)
        } else {
            match &self.source {
                Some(src) => src.get_sample(bucket, &s.key, None).await.map_err(|e| {
                    tracing::warn!(key = %s.key, reason = %e.skip_reason(), error = %e, "skipping sample");
                    e.skip_reason()
                }),
                None => {
                    tracing::warn!(key = %s.key, "no S3 source configured; skipping sample");
                    Err(crate::decode::SkipReason::S3Error)
                }
            }
        };
        EncodedSample {
            key: s.key,
            metadata: s.metadata,
            data,
        }
    }
}

#[tonic::async_trait]
impl DecodeService for DecodeWorker {
    async fn decode_batch(
        &self,
        request: Request<proto::DecodeBatchRequest>,
    ) -> Result<Response<proto::DecodeBatchReply>, Status> {
        let t0 = Instant::now();
        let metrics = &self.state.metrics;
        if self.state.is_draining() {
            metrics.reject("draining");
            return Err(Status::unavailable("worker is draining"));
        }
        let peer = request.remote_addr();
        let req = request.into_inner();
        let transform = self.check(&req, peer)?;
        // Push back instead of buffering: the caller picks another worker or waits.
        let Ok(permit) = self.queue.clone().try_acquire_owned() else {
            metrics.reject("queue_full");
            return Err(Status::resource_exhausted("decode queue full"));
        };
        let n = req.samples.len() as i64;
        self.state.inflight.fetch_add(1, Ordering::SeqCst);
        metrics.inflight_batches.inc();
        metrics.inflight_samples.inc_by(n);
        let _guard = InflightGuard {
            state: self.state.clone(),
            samples: n,
        };
        metrics.samples_in.inc_by(n as u64);

        let t_get = Instant::now();
        let bucket = req.bucket;
        // Samples inside shards: coalesced range GETs (source/members.rs).
        let encoded: Vec<EncodedSample> = if req.samples.iter().any(|s| s.length > 0) {
            let refs: Vec<crate::source::SampleRef> =
                req.samples.into_iter().map(Into::into).collect();
            crate::source::fetch_samples(self.source.as_ref(), &bucket, &refs, Default::default())
                .await
        } else {
            join_all(req.samples.into_iter().map(|s| self.fetch(&bucket, s))).await
        };
        let get_us = t_get.elapsed().as_micros() as u64;

        let (tx, rx) = oneshot::channel();
        let limits = self.limits;
        let pixel_pool = self.pixels.clone();
        let queued_at = Instant::now();
        self.pool.spawn(move || {
            let queue_wait = queued_at.elapsed();
            // A panic in a decoder must cost one batch, not the worker.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                decode_batch_pooled(encoded, &transform, &limits, &pixel_pool)
            }));
            let _ = tx.send((result, queue_wait));
        });
        let (result, queue_wait) = rx
            .await
            .map_err(|_| Status::internal("decode pool dropped the batch"))?;
        let batch = result.map_err(|_| {
            tracing::error!("decoder panicked; batch failed");
            Status::internal("decoder panicked")
        })?;
        drop(permit);

        let t_pack = Instant::now();
        let tm = batch.timings;
        metrics
            .busy_seconds
            .inc_by((tm.decode_cpu + tm.resize_cpu + tm.pack_wall).as_secs_f64());
        for s in &batch.samples {
            match s.skip {
                Some(r) => metrics.skip(r),
                None => {
                    metrics.samples_out.inc();
                }
            }
        }
        metrics.bytes_out.inc_by(batch.pixels.len() as u64);
        // Decode and resize run interleaved in one parallel pass: split its wall time by
        // their CPU shares.
        let cpu = (tm.decode_cpu + tm.resize_cpu).as_secs_f64();
        let resize_share = if cpu > 0.0 {
            tm.resize_cpu.as_secs_f64() / cpu
        } else {
            0.0
        };
        let resize_wall = tm.decode_wall.mul_f64(resize_share);
        let decode_wall = tm.decode_wall.saturating_sub(resize_wall);
        let decoded = batch.decoded_count().max(1) as u32;
        metrics.observe_stage("decode", tm.decode_cpu / decoded);
        metrics.observe_stage("resize", tm.resize_cpu / decoded);
        let samples: Vec<proto::SampleMeta> =
            batch.samples.into_iter().map(meta_to_proto).collect();
        // A pooled buffer, shared into the reply; no copy here (prost copies it once into the
        // encoded message) and back to the pool once the reply is encoded.
        let pixels = batch.pixels;
        let pack = tm.pack_wall + t_pack.elapsed();
        metrics.observe_stage("pack", pack);
        let total = t0.elapsed();
        metrics.batch_seconds.observe(total.as_secs_f64());
        Ok(Response::new(proto::DecodeBatchReply {
            batch_id: req.batch_id,
            pixels,
            samples,
            timings: Some(proto::StageTimings {
                queue_us: queue_wait.as_micros() as u64,
                get_us,
                decode_us: decode_wall.as_micros() as u64,
                resize_us: resize_wall.as_micros() as u64,
                pack_us: pack.as_micros() as u64,
                total_us: total.as_micros() as u64,
                decode_cpu_us: tm.decode_cpu.as_micros() as u64,
                resize_cpu_us: tm.resize_cpu.as_micros() as u64,
            }),
        }))
    }
}
