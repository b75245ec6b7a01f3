//! The sidecar's pipeline: walk the epoch plan, take a free ring slot per batch (the
//! backpressure), decode the batch on a worker (or locally), write it into the slot, and
//! publish it under its sequence number; the hand-off delivers sequence numbers in order
//! (the reorder buffer), so every sample of the epoch reaches the trainer once, in plan order.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;

use super::fleet::{DecodeWorkerHandle, WorkerPool};
use super::metrics::{ReasonLabel, RouteLabel, SidecarMetrics};
use super::plan::{Cursor, PlanConfig, PlanError, Shard};
use super::protocol::{BatchHeader, SampleHeader, monotonic_ns};
use super::ring::{ShmRing, SlotLease};
use super::samples::{PlannedSamples, Samples};
use crate::batch::{EncodedSample, SampleMeta, decode_batch_into};
use crate::decode::{DecodeLimits, SkipReason};
use crate::proto;
use crate::retry::RetryPolicy;
use crate::source::{S3Source, SampleRef};
use crate::transform::Transform;
use crate::worker::{batch_from_reply, transform_to_proto};

/// What the trainer gets next, in sequence order.
#[derive(Debug, Clone)]
pub enum Item {
    Batch(BatchHeader),
    EndOfEpoch(u64),
    Done,
    /// The source refuses the samples from here on: every later request gets this too.
    SourceUnavailable(String),
}

#[derive(Default)]
struct DeliveryState {
    ready: BTreeMap<u64, Item>,
    next_seq: u64,
    /// The stream the items belong to; items of an earlier stream are refused.
    generation: u64,
    /// Where the trainer stands: after the last item handed out.
    standing: Cursor,
}

/// The reorder buffer: items arrive in any order and leave in sequence order.
#[derive(Default)]
pub struct Delivery {
    state: Mutex<DeliveryState>,
    notify: Notify,
}

impl Delivery {
    fn lock(&self) -> std::sync::MutexGuard<'_, DeliveryState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds item `seq` of stream `generation`; false when that stream has been replaced (the
    /// item is dropped, and its slot is the caller's to free).
    #[must_use]
    fn publish(&self, generation: u64, seq: u64, item: Item) -> bool {
        {
            let mut s = self.lock();
            if s.generation != generation {
                return false;
            }
            s.ready.insert(seq, item);
        }
        self.notify.notify_waiters();
        true
    }

    /// Starts stream `generation` at `at`: returns the slots of the batches decoded for the
    /// stream it replaces and never handed out.
    fn reset(&self, generation: u64, at: Cursor) -> Vec<u32> {
        let mut s = self.lock();
        let stale = std::mem::take(&mut s.ready);
        *s = DeliveryState {
            generation,
            standing: at,
            ..DeliveryState::default()
        };
        drop(s);
        self.notify.notify_waiters();
        stale
            .into_values()
            .filter_map(|item| match item {
                Item::Batch(header) => Some(header.slot),
                Item::EndOfEpoch(_) | Item::Done | Item::SourceUnavailable(_) => None,
            })
            .collect()
    }

    /// Where the trainer stands in the epochs: after the last item handed out.
    pub fn standing(&self) -> Cursor {
        self.lock().standing
    }

    /// Batches decoded and not yet delivered.
    pub fn ready_batches(&self) -> usize {
        let s = self.lock();
        s.ready
            .range(s.next_seq..)
            .filter(|(_, i)| matches!(i, Item::Batch(_)))
            .count()
    }

    /// Takes the next item in order, waiting up to `wait`.
    pub async fn next(&self, wait: Duration) -> Option<Item> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.lock();
                let seq = s.next_seq;
                if let Some(item) = s.ready.remove(&seq) {
                    match &item {
                        // These stay: every later request gets them too.
                        Item::Done | Item::SourceUnavailable(_) => {
                            s.ready.insert(seq, item.clone());
                        }
                        Item::Batch(header) => {
                            s.next_seq += 1;
                            s.standing = Cursor {
                                epoch: header.epoch,
                                position: header.position as usize,
                            };
                        }
                        Item::EndOfEpoch(epoch) => {
                            s.next_seq += 1;
                            s.standing = Cursor {
                                epoch: epoch + 1,
                                position: 0,
                            };
                        }
                    }
                    return Some(item);
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// Batches waiting for a busy fleet, in sequence order. Only the oldest retries: the trainer
/// needs it next, and batches that retried at random (each on its own backoff) left it waiting
/// behind younger ones while the fleet was full, stalling the trainer for seconds.
#[derive(Default)]
pub struct BusyTurns {
    waiting: Mutex<BTreeSet<u64>>,
    notify: Notify,
}

/// Pause before the oldest waiting batch asks a full fleet again (10 ms, doubling to 80 ms
/// while it stays full), unless a batch of ours comes back first. Other sidecars' batches free
/// slots too, and only asking sees those. No jitter: one batch asks at a time.
const BUSY_PAUSE: RetryPolicy =
    RetryPolicy::doubling(Duration::from_millis(5), Duration::from_millis(80));
/// Pause before a batch that every available worker failed is sent again (40 ms to 640 ms).
const FAULT_PAUSE: RetryPolicy =
    RetryPolicy::doubling(Duration::from_millis(20), Duration::from_millis(640));
/// A worker that has not refused a batch by then has taken it: the next in line may ask.
const TAKEN_AFTER: Duration = Duration::from_millis(50);
/// Pause before a batch whose samples S3 failed is decoded again (1 s, doubling to 16 s).
const SOURCE_PAUSE: RetryPolicy =
    RetryPolicy::doubling(Duration::from_millis(500), Duration::from_secs(16));
/// Longest a waiting batch sleeps before it looks again, should a wake-up be missed.
const TURN_RECHECK: Duration = Duration::from_millis(500);

impl BusyTurns {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until `seq` is the oldest batch waiting, then `pause` more or until a slot frees.
    /// `seq` stays in line until it [`leave`](Self::leave)s.
    pub async fn wait(&self, seq: u64, pause: Duration) {
        self.lock().insert(seq);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.lock().first() == Some(&seq) {
                let _ = tokio::time::timeout(pause, notified).await;
                return;
            }
            let _ = tokio::time::timeout(TURN_RECHECK, notified).await;
        }
    }

    /// `seq` was taken by a worker (or goes elsewhere): the next oldest takes its turn.
    pub fn leave(&self, seq: u64) {
        if self.lock().remove(&seq) {
            self.notify.notify_waiters();
        }
    }

    /// A batch came back from a worker: its slot there is free for the oldest waiting.
    pub fn slot_freed(&self) {
        self.notify.notify_waiters();
    }
}

/// Everything the pipeline needs, shared by its tasks, the hand-off and the HTTP endpoints.
pub struct Pipeline {
    /// The bucket the decode requests name (the shards' with an index).
    pub bucket: String,
    pub samples: Samples,
    /// Seed, batch size, shuffle and drop_last of every stream; the shard is the stream's.
    pub plan: PlanConfig,
    /// Where a stream starts unless the trainer seeks (the flags' resume point).
    pub start: Cursor,
    /// 0 = no limit.
    pub epochs: u64,
    pub transform: Transform,
    pub limits: DecodeLimits,
    pub batch_timeout: Duration,
    /// How long a batch is decoded again while S3 fails transiently before delivery stops.
    pub source_retry: Duration,
    /// Decode locally when no worker is available (and always when none is configured).
    pub local_fallback: bool,
    /// f64 bits of the share of batches decoded locally (0..=1), changeable at runtime.
    pub local_share: AtomicU64,
    pub local_pool: Arc<rayon::ThreadPool>,
    pub source: S3Source,
    pub fleet: Arc<WorkerPool>,
    pub ring: Arc<ShmRing>,
    pub delivery: Delivery,
    pub busy_turns: BusyTurns,
    pub metrics: Arc<SidecarMetrics>,
    pub stream: Mutex<Stream>,
    /// Why the source refuses the samples, while delivery is stopped for it (shared by the
    /// pod's ranks; [`super::events`] reports it).
    pub source_down: Arc<watch::Sender<Option<String>>>,
}

/// The stream of batches decoded for the trainer: for which rank, and the task that walks it.
pub struct Stream {
    pub shard: Shard,
    generation: u64,
    walker: Option<AbortHandle>,
}

impl Stream {
    pub fn new(shard: Shard) -> Self {
        Self {
            shard,
            generation: 0,
            walker: None,
        }
    }
}

/// One batch to decode, and where it sits in the stream.
struct Planned {
    turn: Turn,
    samples: PlannedSamples,
}

/// Where a batch goes in the stream.
#[derive(Clone, Copy)]
struct Turn {
    generation: u64,
    seq: u64,
    epoch: u64,
    index: u64,
    batch_id: u64,
    /// The epoch's position once every rank has consumed this batch.
    position: usize,
}

/// Each sample's header, its pixels copied into `slot` from a worker's reply (the one copy)
/// or already there; a sample that does not fit the slot becomes a `tooLarge` skip. Returns the
/// headers and the bytes of the slot in use.
fn lay_into_slot(decoded: Decoded, slot: &mut [u8], slot_bytes: usize) -> (Vec<SampleHeader>, u64) {
    let mut samples = Vec::with_capacity(decoded.samples.len());
    let mut used = 0u64;
    for m in decoded.samples {
        let mut skip = m.skip.map(|r| r.as_str().to_string());
        let (start, len) = (m.offset as usize, m.byte_len());
        let received = match &decoded.pixels {
            Pixels::Received(pixels) => Some(pixels),
            Pixels::InSlot => None,
        };
        let fits = start + len <= slot_bytes && received.is_none_or(|p| start + len <= p.len());
        if skip.is_none() && !fits {
            // Only with variable output sizes (qwenSmart) and a too small --slot-bytes.
            tracing::warn!(key = %m.key, slot_bytes, "sample does not fit in the slot; skipping");
            skip = Some(SkipReason::TooLarge.as_str().to_string());
        }
        let shape = if skip.is_none() {
            if let Some(pixels) = received {
                slot[start..start + len].copy_from_slice(&pixels[start..start + len]);
            }
            used = used.max((start + len) as u64);
            [m.height, m.width, 3]
        } else {
            [0, 0, 3]
        };
        samples.push(SampleHeader {
            key: m.key,
            metadata: m.metadata,
            shape,
            offset: m.offset,
            skip,
        });
    }
    (samples, used)
}

/// A decoded batch, and where its pixels are.
struct Decoded {
    pixels: Pixels,
    samples: Vec<SampleMeta>,
    route: &'static str,
}

enum Pixels {
    /// A worker's reply, still to be copied into the slot.
    Received(Bytes),
    /// Decoded locally straight into the slot (or nothing decoded): nothing to copy.
    InSlot,
}

/// Why a worker gave no batch back (the retry reason), and whether that counts against it.
struct CallFailure {
    reason: &'static str,
    fault: bool,
}

impl CallFailure {
    fn fault(reason: &'static str) -> Self {
        Self {
            reason,
            fault: true,
        }
    }
}

/// What is wrong with a worker's reply, if anything, before any of it is used: one sample per
/// request in the same order, and every decoded sample's pixels inside the reply. A reply that
/// fails is the worker's fault and the batch goes to another worker; it never reaches the slot.
fn reply_problem(reply: &proto::DecodeBatchReply, refs: &[SampleRef]) -> Option<&'static str> {
    if reply.samples.len() != refs.len() {
        return Some("sample count");
    }
    let pixels = reply.pixels.len() as u64;
    for (m, asked) in reply.samples.iter().zip(refs) {
        if m.key != asked.key {
            return Some("keys differ from the request");
        }
        if !m.skip_reason.is_empty() {
            continue;
        }
        let len = u64::from(m.width)
            .checked_mul(u64::from(m.height))
            .and_then(|p| p.checked_mul(3));
        let end = len.and_then(|len| m.offset.checked_add(len));
        if end.is_none_or(|end| end > pixels) {
            return Some("pixels outside the reply");
        }
    }
    None
}

impl Pipeline {
    pub fn batches_per_epoch(&self) -> u64 {
        self.plan().batches_per_epoch(self.samples.len()) as u64
    }

    pub fn local_share(&self) -> f64 {
        f64::from_bits(self.local_share.load(Ordering::SeqCst))
    }

    pub fn set_local_share(&self, share: f64) {
        let share = share.clamp(0.0, 1.0);
        self.local_share.store(share.to_bits(), Ordering::SeqCst);
        self.metrics.local_share.set(share);
    }

    fn lock_stream(&self) -> std::sync::MutexGuard<'_, Stream> {
        self.stream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The rank this pipeline decodes for now.
    pub fn shard(&self) -> Shard {
        self.lock_stream().shard
    }

    /// The plan of the current stream's rank.
    pub fn plan(&self) -> PlanConfig {
        PlanConfig {
            shard: self.shard(),
            ..self.plan
        }
    }

    /// Starts the stream at the start point for the rank it was built for; when that rank is
    /// not in the world (the pod knows its node rank, not the world size), the first trainer's
    /// `hello` starts it.
    pub fn start(self: &Arc<Self>) -> Result<(), PlanError> {
        match self.restart(self.shard(), self.start) {
            Err(PlanError::RankOutOfRange { rank, world_size }) => {
                tracing::info!(
                    rank,
                    world_size,
                    "waiting for the trainer's rank and world size"
                );
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }

    /// Whether a stream runs (false until a rank in the world is known).
    pub fn started(&self) -> bool {
        self.lock_stream().walker.is_some()
    }

    /// Replaces the stream: from `from`, for `shard`. Batches decoded for the old stream and not
    /// handed out are dropped and their slots freed; batches still decoding are dropped when
    /// they finish. Returns the batches left in `from`'s epoch for this rank.
    pub fn restart(self: &Arc<Self>, shard: Shard, from: Cursor) -> Result<u64, PlanError> {
        let plan = PlanConfig { shard, ..self.plan };
        plan.validate(self.samples.len())?;
        let mut stream = self.lock_stream();
        if let Some(walker) = stream.walker.take() {
            walker.abort();
        }
        stream.generation += 1;
        stream.shard = shard;
        // A new stream tries the source again.
        self.source_down.send_replace(None);
        self.metrics.source_unavailable.set(0);
        for slot in self.delivery.reset(stream.generation, from) {
            if let Err(err) = self.ring.release(slot) {
                tracing::warn!(%err, "freeing a slot of the replaced stream");
            }
        }
        let walk = tokio::spawn(self.clone().walk(stream.generation, plan, from));
        stream.walker = Some(walk.abort_handle());
        Ok(plan.batches_left(self.samples.len(), from) as u64)
    }

    /// Walks the epochs from `from`; returns after the last epoch (never, by default).
    async fn walk(self: Arc<Self>, generation: u64, plan: PlanConfig, from: Cursor) {
        let samples = self.samples.len();
        let batches_per_epoch = plan.batches_per_epoch(samples) as u64;
        let mut seq = 0u64;
        let mut cursor = from;
        loop {
            if self.epochs > 0 && cursor.epoch >= self.epochs {
                let _ = self.delivery.publish(generation, seq, Item::Done);
                return;
            }
            self.metrics.epoch.set(cursor.epoch as i64);
            let epoch = self.samples.batches_from(&plan, cursor);
            for (j, (batch, position)) in epoch.batches.enumerate() {
                // Waiting here is what keeps memory flat when the trainer stops consuming.
                let lease = self.ring.acquire().await;
                let index = epoch.first_index + j as u64;
                let planned = Planned {
                    turn: Turn {
                        generation,
                        seq,
                        epoch: cursor.epoch,
                        index,
                        batch_id: cursor.epoch * batches_per_epoch + index,
                        position,
                    },
                    samples: batch,
                };
                self.metrics.inflight_batches.inc();
                tokio::spawn(self.clone().fill(planned, lease));
                seq += 1;
            }
            let _ = self
                .delivery
                .publish(generation, seq, Item::EndOfEpoch(cursor.epoch));
            seq += 1;
            cursor = Cursor {
                epoch: cursor.epoch + 1,
                position: 0,
            };
        }
    }

    /// One planned batch, start to end: decode it (until S3 gave every sample), lay its
    /// samples into the slot, publish it in its turn. A source that stays down stops delivery.
    async fn fill(self: Arc<Self>, planned: Planned, lease: SlotLease) {
        let Planned { turn, samples } = planned;
        let Turn {
            generation,
            seq,
            batch_id,
            ..
        } = turn;
        if self.lock_stream().generation != generation {
            // Replaced before its turn came: the lease frees the slot.
            self.metrics.inflight_batches.dec();
            return;
        }
        let decoded = match samples.resolve(&self.source).await {
            Ok(refs) => self.decode_sourced(seq, batch_id, &refs, lease).await,
            // The index's own retries are spent: as for the data, the trainer is told.
            Err(err) => Err(format!("reading the dataset index: {err}")),
        };
        match decoded {
            Ok((decoded, lease)) => self.publish_batch(turn, decoded, lease),
            Err(message) => self.stop_on_source_down(generation, seq, message),
        }
    }

    /// The source refuses samples for good: the trainer is told in this batch's turn, and the
    /// condition shows (see `events`).
    fn stop_on_source_down(&self, generation: u64, seq: u64, message: String) {
        tracing::error!(%message, "source unavailable; delivery stops");
        self.source_down.send_replace(Some(message.clone()));
        self.metrics.source_unavailable.set(1);
        self.metrics.inflight_batches.dec();
        let _ = self
            .delivery
            .publish(generation, seq, Item::SourceUnavailable(message));
    }

    /// Lays `decoded` into the slot and hands its header to delivery, which gives it to the
    /// trainer in order.
    fn publish_batch(&self, turn: Turn, decoded: Decoded, mut lease: SlotLease) {
        let slot_bytes = self.ring.slot_bytes();
        let route = decoded.route;
        let (samples, used) = lay_into_slot(decoded, lease.bytes_mut(), slot_bytes);
        let slot_index = lease.index();
        let header = BatchHeader {
            slot: slot_index,
            slot_offset: u64::from(slot_index) * slot_bytes as u64,
            nbytes: used,
            epoch: turn.epoch,
            index: turn.index,
            batch_id: turn.batch_id,
            position: turn.position as u64,
            dtype: "uint8".into(),
            samples,
            ready_ns: monotonic_ns(),
            route: route.into(),
        };
        let slot = lease.publish();
        self.metrics.inflight_batches.dec();
        if !self
            .delivery
            .publish(turn.generation, turn.seq, Item::Batch(header))
        {
            // The trainer moved the stream (seek, new rank) while this batch was decoding.
            if let Err(err) = self.ring.release(slot) {
                tracing::warn!(%err, "freeing a slot of the replaced stream");
            }
        }
        self.metrics
            .ready_batches
            .set(self.delivery.ready_batches() as i64);
    }

    /// Decodes one batch until S3 gave every sample: a transient failure (throttling, 5xx,
    /// network, after the GET's own retries) decodes the batch again after a pause, for up to
    /// `source_retry`; refused access or a missing bucket ends at once. A sample is never
    /// delivered as missing because S3 was unwell. Errs with what the trainer is told.
    async fn decode_sourced(
        &self,
        seq: u64,
        batch_id: u64,
        refs: &[SampleRef],
        mut lease: SlotLease,
    ) -> Result<(Decoded, SlotLease), String> {
        let start = tokio::time::Instant::now();
        let mut round = 0u32;
        loop {
            let (decoded, back) = self.decode(seq, batch_id, refs, lease).await;
            let failed = |reason| decoded.samples.iter().find(|m| m.skip == Some(reason));
            if let Some(m) = failed(SkipReason::SourceUnavailable) {
                return Err(format!(
                    "s3://{}/{}: access refused or no such bucket (credentials, bucket policy or \
                     the bucket itself)",
                    self.bucket, m.key
                ));
            }
            let Some(m) = failed(SkipReason::S3Error) else {
                return Ok((decoded, back));
            };
            if start.elapsed() >= self.source_retry {
                return Err(format!(
                    "s3://{}/{}: S3 kept failing for {:.0} s (throttling, server errors or network)",
                    self.bucket,
                    m.key,
                    start.elapsed().as_secs_f64()
                ));
            }
            tracing::warn!(key = %m.key, batch_id, round, "S3 failing; decoding the batch again");
            self.metrics.retry("source");
            round += 1;
            tokio::time::sleep(SOURCE_PAUSE.backoff(round)).await;
            lease = back;
        }
    }

    /// Whether batch `seq` goes to the local decoder under the current share: spreads the
    /// local batches evenly (share 0.25 = every fourth batch).
    fn routed_locally(&self, seq: u64) -> bool {
        let share = self.local_share();
        if share <= 0.0 {
            return false;
        }
        if share >= 1.0 {
            return true;
        }
        ((seq + 1) as f64 * share).floor() > (seq as f64 * share).floor()
    }

    /// Decodes one batch for `lease`'s slot; never fails: it retries on other workers, falls
    /// back to local decode when no worker is available, and reports bad samples as skips.
    async fn decode(
        &self,
        seq: u64,
        batch_id: u64,
        refs: &[SampleRef],
        lease: SlotLease,
    ) -> (Decoded, SlotLease) {
        if self.routed_locally(seq) {
            return self.decode_locally(refs, lease).await;
        }
        let mut tried: HashSet<String> = HashSet::new();
        let mut faults = 0u32;
        let mut busy_rounds = 0u32;
        let mut all_busy = true;
        loop {
            let Some(out) = self.fleet.pick(&tried) else {
                if self.fleet.counts().available == 0 && self.local_fallback {
                    self.busy_turns.leave(seq);
                    return self.decode_locally(refs, lease).await;
                }
                // Every available worker was tried: a full fleet frees a slot soon, a failing
                // one is given time.
                let pause = if all_busy {
                    busy_rounds += 1;
                    BUSY_PAUSE.backoff(busy_rounds)
                } else {
                    faults += 1;
                    FAULT_PAUSE.backoff(faults)
                };
                tried.clear();
                all_busy = true;
                self.busy_turns.wait(seq, pause).await;
                continue;
            };
            let worker = out.worker().clone();
            let outcome = self.ask_worker(&worker, seq, batch_id, refs).await;
            drop(out);
            if !matches!(outcome, Err(CallFailure { reason: "busy", .. })) {
                self.busy_turns.leave(seq);
                self.busy_turns.slot_freed();
            }
            match outcome {
                Ok(reply) => return (self.received(&worker, reply), lease),
                Err(failure) => {
                    all_busy &= !failure.fault;
                    self.note_failure(&worker, batch_id, failure);
                    tried.insert(worker.endpoint.clone());
                }
            }
        }
    }

    /// Sends one batch to `worker` and waits up to the batch timeout; a worker that has not
    /// refused it within [`TAKEN_AFTER`] has taken it, and the next batch in line may ask.
    async fn ask_worker(
        &self,
        worker: &DecodeWorkerHandle,
        seq: u64,
        batch_id: u64,
        refs: &[SampleRef],
    ) -> Result<proto::DecodeBatchReply, CallFailure> {
        let request = proto::DecodeBatchRequest {
            batch_id,
            bucket: self.bucket.clone(),
            samples: refs.iter().map(proto::SampleRef::from).collect(),
            transform: Some(transform_to_proto(&self.transform)),
        };
        let Ok(mut client) = worker.client().await else {
            return Err(CallFailure::fault("connect"));
        };
        let call = async {
            let call = client.decode_batch(request);
            tokio::pin!(call);
            tokio::select! {
                answer = &mut call => answer,
                () = tokio::time::sleep(TAKEN_AFTER) => {
                    self.busy_turns.leave(seq);
                    call.await
                }
            }
        };
        match tokio::time::timeout(self.batch_timeout, call).await {
            Ok(Ok(reply)) => match reply_problem(&reply, refs) {
                None => Ok(reply),
                Some(problem) => {
                    tracing::warn!(worker = %worker.endpoint, batch_id, problem, "reply refused");
                    Err(CallFailure::fault("bad_reply"))
                }
            },
            Ok(Err(status)) => Err(match status.code() {
                // A full queue is not a fault: try another worker.
                tonic::Code::ResourceExhausted => CallFailure {
                    reason: "busy",
                    fault: false,
                },
                tonic::Code::Unavailable => CallFailure::fault("unavailable"),
                _ => CallFailure::fault("error"),
            }),
            Err(_) => Err(CallFailure::fault("timeout")),
        }
    }

    /// A worker's answer, counted; its pixels are still to be copied into the slot.
    fn received(&self, worker: &DecodeWorkerHandle, mut reply: proto::DecodeBatchReply) -> Decoded {
        self.fleet.succeeded(worker);
        let pixels = std::mem::take(&mut reply.pixels);
        self.metrics.bytes_received.inc_by(pixels.len() as u64);
        self.metrics
            .batches_decoded
            .get_or_create(&RouteLabel { route: "remote" })
            .inc();
        Decoded {
            pixels: Pixels::Received(pixels),
            samples: batch_from_reply(reply).samples,
            route: "remote",
        }
    }

    /// Counts a call that gave no batch, and sets the worker aside when it keeps failing.
    fn note_failure(&self, worker: &DecodeWorkerHandle, batch_id: u64, failure: CallFailure) {
        let CallFailure { reason, fault } = failure;
        self.metrics.retry(reason);
        if fault && self.fleet.failed(worker) {
            tracing::warn!(worker = %worker.endpoint, "worker keeps failing; set aside");
        }
        if fault {
            tracing::info!(worker = %worker.endpoint, batch_id, reason, "batch failed; re-sending");
        } else {
            // A full worker is routine while the fleet is short: counted, not logged.
            tracing::debug!(worker = %worker.endpoint, batch_id, "worker busy; asking again");
        }
    }

    /// Fetches and decodes one batch here, straight into `lease`'s slot.
    async fn decode_locally(&self, refs: &[SampleRef], lease: SlotLease) -> (Decoded, SlotLease) {
        let encoded: Vec<EncodedSample> = crate::source::fetch_samples(
            Some(&self.source),
            &self.bucket,
            refs,
            Default::default(),
        )
        .await;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (transform, limits) = (self.transform, self.limits);
        let mut lease = lease;
        self.local_pool.spawn(move || {
            // A panic in a decoder must cost one batch, not the sidecar.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                decode_batch_into(&encoded, &transform, &limits, lease.bytes_mut())
            }));
            let _ = tx.send((result, encoded, lease));
        });
        self.metrics
            .batches_decoded
            .get_or_create(&RouteLabel { route: "local" })
            .inc();
        match rx.await {
            Ok((Ok(batch), _, lease)) => {
                let decoded = Decoded {
                    pixels: Pixels::InSlot,
                    samples: batch.samples,
                    route: "local",
                };
                (decoded, lease)
            }
            Ok((Err(_), encoded, lease)) => {
                tracing::error!(
                    "local decoder panicked; the batch's samples are reported as corrupt"
                );
                let keys = encoded.iter().map(|s| (&s.key, &s.metadata));
                (all_skipped(keys, SkipReason::Corrupt), lease)
            }
            // The pool went away with the slot: take another for the skips.
            Err(_) => {
                let keys = refs.iter().map(|s| (&s.key, &s.metadata));
                (
                    all_skipped(keys, SkipReason::Corrupt),
                    self.ring.acquire().await,
                )
            }
        }
    }
}

/// Every sample of a batch, as (key, metadata), skipped for `reason`.
fn all_skipped<'a>(
    samples: impl Iterator<Item = (&'a String, &'a String)>,
    reason: SkipReason,
) -> Decoded {
    Decoded {
        pixels: Pixels::InSlot,
        samples: samples
            .map(|(key, metadata)| SampleMeta {
                key: key.clone(),
                metadata: metadata.clone(),
                skip: Some(reason),
                ..SampleMeta::default()
            })
            .collect(),
        route: "local",
    }
}

/// Counts a delivered batch's samples and skips.
pub fn count_delivered(metrics: &SidecarMetrics, header: &BatchHeader) {
    metrics.batches_delivered.inc();
    metrics
        .samples_delivered
        .inc_by(header.samples.len() as u64);
    for s in &header.samples {
        if let Some(reason) = s.skip.as_deref() {
            let reason = SkipReason::parse(reason).map_or("other", SkipReason::as_str);
            metrics
                .samples_skipped
                .get_or_create(&ReasonLabel { reason })
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn batches_waiting_for_a_busy_fleet_take_turns_oldest_first() {
        let turns = Arc::new(BusyTurns::default());
        // Batch 1 waits first, alone: its turn at once; it holds the others until it leaves.
        turns.wait(1, Duration::ZERO).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // They start waiting youngest first; they must go oldest first.
        for seq in [7u64, 5, 6] {
            let (turns, tx) = (turns.clone(), tx.clone());
            tokio::spawn(async move {
                turns.wait(seq, Duration::ZERO).await;
                tx.send(seq).unwrap();
            });
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(rx.try_recv().is_err(), "none goes while batch 1 waits");
        turns.leave(1);
        let mut order = Vec::new();
        for _ in 0..3 {
            let seq = tokio::time::timeout(Duration::from_secs(2), rx.recv())
                .await
                .expect("a turn within the recheck")
                .unwrap();
            order.push(seq);
            assert!(
                tokio::time::timeout(Duration::from_millis(50), rx.recv())
                    .await
                    .is_err(),
                "one turn at a time: {order:?}"
            );
            turns.leave(seq);
        }
        assert_eq!(order, [5, 6, 7]);
    }

    #[tokio::test]
    async fn delivery_reorders_by_sequence() {
        let d = Delivery::default();
        assert!(d.publish(0, 1, Item::EndOfEpoch(1)));
        assert!(
            d.next(Duration::from_millis(20)).await.is_none(),
            "seq 0 is missing"
        );
        assert!(d.publish(0, 0, Item::EndOfEpoch(0)));
        assert!(matches!(
            d.next(Duration::ZERO).await,
            Some(Item::EndOfEpoch(0))
        ));
        assert!(matches!(
            d.next(Duration::ZERO).await,
            Some(Item::EndOfEpoch(1))
        ));
        assert!(d.publish(0, 2, Item::Done));
        assert!(matches!(d.next(Duration::ZERO).await, Some(Item::Done)));
        assert!(
            matches!(d.next(Duration::ZERO).await, Some(Item::Done)),
            "done repeats"
        );
    }

    #[test]
    fn a_forged_reply_is_refused_before_use() {
        let refs: Vec<SampleRef> = ["a.jpg", "b.jpg"]
            .iter()
            .map(|k| SampleRef {
                key: k.to_string(),
                ..SampleRef::default()
            })
            .collect();
        let sample = |key: &str, offset: u64| proto::SampleMeta {
            key: key.to_string(),
            width: 2,
            height: 2,
            offset,
            ..proto::SampleMeta::default()
        };
        let reply = |samples| proto::DecodeBatchReply {
            samples,
            pixels: Bytes::from(vec![1u8; 24]),
            ..proto::DecodeBatchReply::default()
        };
        let good = reply(vec![sample("a.jpg", 0), sample("b.jpg", 12)]);
        assert_eq!(reply_problem(&good, &refs), None);
        for (forged, problem) in [
            (
                reply(vec![sample("a.jpg", 0), sample("b.jpg", u64::MAX - 4)]),
                "pixels outside the reply",
            ),
            (
                reply(vec![sample("a.jpg", 0), sample("b.jpg", 13)]),
                "pixels outside the reply",
            ),
            (
                reply(vec![sample("a.jpg", 0), sample("secret.jpg", 12)]),
                "keys differ from the request",
            ),
            (reply(vec![sample("a.jpg", 0)]), "sample count"),
        ] {
            assert_eq!(reply_problem(&forged, &refs), Some(problem));
        }
    }

    #[tokio::test]
    async fn a_reset_drops_the_old_stream_and_starts_where_asked() {
        let d = Delivery::default();
        let header = |slot, position| {
            Item::Batch(BatchHeader {
                slot,
                slot_offset: 0,
                nbytes: 0,
                epoch: 3,
                index: 0,
                batch_id: 0,
                position,
                dtype: "uint8".into(),
                samples: Vec::new(),
                ready_ns: 0,
                route: "local".into(),
            })
        };
        assert!(d.publish(0, 0, header(4, 8)));
        assert!(d.publish(0, 1, header(5, 16)));
        assert!(matches!(d.next(Duration::ZERO).await, Some(Item::Batch(_))));
        assert_eq!(
            d.standing(),
            Cursor {
                epoch: 3,
                position: 8
            }
        );
        let at = Cursor {
            epoch: 3,
            position: 4,
        };
        assert_eq!(
            d.reset(1, at),
            vec![5],
            "the undelivered batch's slot comes back"
        );
        assert_eq!(d.standing(), at);
        assert!(
            !d.publish(0, 2, header(6, 24)),
            "a batch of the old stream is refused"
        );
        assert!(d.next(Duration::from_millis(10)).await.is_none());
        assert!(d.publish(1, 0, Item::EndOfEpoch(3)));
        assert!(matches!(
            d.next(Duration::ZERO).await,
            Some(Item::EndOfEpoch(3))
        ));
        assert_eq!(
            d.standing(),
            Cursor {
                epoch: 4,
                position: 0
            }
        );
    }
}
