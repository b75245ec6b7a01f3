//! The sidecar's pipeline: walk the epoch plan, take a free ring slot per batch (the
//! backpressure), decode the batch on a worker (or locally), write it into the slot, and
//! publish it under its sequence number; the hand-off delivers sequence numbers in order
//! (the reorder buffer), so every sample of the epoch reaches the trainer once, in plan order.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use tokio::sync::Notify;

use super::fleet::{DecodeWorkerHandle, DecoderFleet};
use super::metrics::{ReasonLabel, RouteLabel, SidecarMetrics};
use super::plan::PlanConfig;
use super::protocol::{BatchHeader, SampleHeader, monotonic_ns};
use super::ring::{ShmRing, SlotLease};
use crate::batch::{EncodedSample, SampleMeta, decode_batch_into};
use crate::decode::{DecodeLimits, SkipReason};
use crate::proto;
use crate::source::{S3Source, SampleRef};
use crate::transform::Transform;
use crate::worker::{batch_from_reply, transform_to_proto};

/// What the trainer gets next, in sequence order.
#[derive(Debug, Clone)]
pub enum Item {
    Batch(BatchHeader),
    EndOfEpoch(u64),
    Done,
}

#[derive(Default)]
struct DeliveryState {
    ready: BTreeMap<u64, Item>,
    next_seq: u64,
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

    pub fn publish(&self, seq: u64, item: Item) {
        self.lock().ready.insert(seq, item);
        self.notify.notify_waiters();
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
                    // `Done` stays: every later request gets it too.
                    if matches!(item, Item::Done) {
                        s.ready.insert(seq, Item::Done);
                    } else {
                        s.next_seq += 1;
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

/// Pause before the oldest waiting batch asks a full fleet again (doubling to 8x while it stays
/// full), unless a batch of ours comes back first. Other sidecars' batches free slots too, and
/// only asking sees those.
const BUSY_PAUSE: Duration = Duration::from_millis(10);
/// A worker that has not refused a batch by then has taken it: the next in line may ask.
const TAKEN_AFTER: Duration = Duration::from_millis(50);
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
    pub bucket: String,
    pub samples: Arc<Vec<SampleRef>>,
    pub plan: PlanConfig,
    pub start_epoch: u64,
    pub start_batch: u64,
    /// 0 = no limit.
    pub epochs: u64,
    pub transform: Transform,
    pub limits: DecodeLimits,
    pub batch_timeout: Duration,
    /// Decode locally when no worker is available (and always when none is configured).
    pub local_fallback: bool,
    /// f64 bits of the share of batches decoded locally (0..=1), changeable at runtime.
    pub local_share: AtomicU64,
    pub local_pool: Arc<rayon::ThreadPool>,
    pub source: S3Source,
    pub fleet: Arc<DecoderFleet>,
    pub ring: Arc<ShmRing>,
    pub delivery: Delivery,
    pub busy_turns: BusyTurns,
    pub metrics: Arc<SidecarMetrics>,
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

impl Pipeline {
    pub fn batches_per_epoch(&self) -> u64 {
        self.plan.batches_per_epoch(self.samples.len()) as u64
    }

    pub fn local_share(&self) -> f64 {
        f64::from_bits(self.local_share.load(Ordering::SeqCst))
    }

    pub fn set_local_share(&self, share: f64) {
        let share = share.clamp(0.0, 1.0);
        self.local_share.store(share.to_bits(), Ordering::SeqCst);
        self.metrics.local_share.set(share);
    }

    /// Walks the epochs from the start point; returns after the last epoch (never, by default).
    pub async fn run(self: Arc<Self>) {
        let mut seq = 0u64;
        let mut epoch = self.start_epoch;
        let mut first = self.start_batch as usize;
        let bpe = self.batches_per_epoch();
        loop {
            if self.epochs > 0 && epoch >= self.epochs {
                self.delivery.publish(seq, Item::Done);
                return;
            }
            self.metrics.epoch.set(epoch as i64);
            let plan = self.plan.epoch(self.samples.len(), epoch);
            for (index, batch) in plan.batches.iter().enumerate().skip(first) {
                // Waiting here is what keeps memory flat when the trainer stops consuming.
                let lease = self.ring.acquire().await;
                let refs: Vec<SampleRef> = batch.iter().map(|&i| self.samples[i].clone()).collect();
                let id = epoch * bpe + index as u64;
                self.metrics.inflight_batches.inc();
                tokio::spawn(self.clone().fill(seq, epoch, index as u64, id, refs, lease));
                seq += 1;
            }
            self.delivery.publish(seq, Item::EndOfEpoch(epoch));
            seq += 1;
            first = 0;
            epoch += 1;
        }
    }

    async fn fill(
        self: Arc<Self>,
        seq: u64,
        epoch: u64,
        index: u64,
        batch_id: u64,
        refs: Vec<SampleRef>,
        lease: SlotLease,
    ) {
        let (decoded, mut lease) = self.decode(seq, batch_id, &refs, lease).await;
        let slot_bytes = self.ring.slot_bytes();
        let slot = lease.bytes_mut();
        let mut samples = Vec::with_capacity(decoded.samples.len());
        let mut used = 0u64;
        for m in decoded.samples {
            let mut skip = m.skip.map(|r| r.as_str().to_string());
            let (start, len) = (m.offset as usize, m.byte_len());
            let mut shape = [m.height, m.width, 3];
            if skip.is_none() {
                let fits = start + len <= slot_bytes
                    && match &decoded.pixels {
                        Pixels::Received(pixels) => start + len <= pixels.len(),
                        Pixels::InSlot => true,
                    };
                if !fits {
                    // Only with variable output sizes (qwenSmart) and a too small --slot-bytes.
                    tracing::warn!(key = %m.key, slot_bytes, "sample does not fit in the slot; skipping");
                    skip = Some(SkipReason::TooLarge.as_str().to_string());
                    shape = [0, 0, 3];
                } else {
                    if let Pixels::Received(pixels) = &decoded.pixels {
                        // The one copy: from the worker's reply into shared memory.
                        slot[start..start + len].copy_from_slice(&pixels[start..start + len]);
                    }
                    used = used.max((start + len) as u64);
                }
            } else {
                shape = [0, 0, 3];
            }
            samples.push(SampleHeader {
                key: m.key,
                metadata: m.metadata,
                shape,
                offset: m.offset,
                skip,
            });
        }
        let slot_index = lease.index();
        let header = BatchHeader {
            slot: slot_index,
            slot_offset: u64::from(slot_index) * slot_bytes as u64,
            nbytes: used,
            epoch,
            index,
            batch_id,
            dtype: "uint8".into(),
            samples,
            ready_ns: monotonic_ns(),
            route: decoded.route.into(),
        };
        lease.publish();
        self.metrics.inflight_batches.dec();
        self.delivery.publish(seq, Item::Batch(header));
        self.metrics
            .ready_batches
            .set(self.delivery.ready_batches() as i64);
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
                    BUSY_PAUSE * (1 << busy_rounds.min(4).saturating_sub(1))
                } else {
                    faults += 1;
                    Duration::from_millis(20u64 << faults.min(5))
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
            samples: refs
                .iter()
                .map(|s| proto::SampleRef {
                    key: s.key.clone(),
                    metadata: s.metadata.clone(),
                    inline: Bytes::new(),
                })
                .collect(),
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
            Ok(Ok(reply)) if reply.samples.len() == refs.len() => Ok(reply),
            Ok(Ok(_)) => Err(CallFailure::fault("bad_reply")),
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
        let encoded: Vec<EncodedSample> = join_all(refs.iter().map(|s| async move {
            let data = self.source.get(&self.bucket, &s.key).await.map_err(|e| {
                tracing::warn!(key = %s.key, reason = %e.skip_reason(), error = %e, "skipping sample");
                e.skip_reason()
            });
            EncodedSample {
                key: s.key.clone(),
                metadata: s.metadata.clone(),
                data,
            }
        }))
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
        d.publish(1, Item::EndOfEpoch(1));
        assert!(
            d.next(Duration::from_millis(20)).await.is_none(),
            "seq 0 is missing"
        );
        d.publish(0, Item::EndOfEpoch(0));
        assert!(matches!(
            d.next(Duration::ZERO).await,
            Some(Item::EndOfEpoch(0))
        ));
        assert!(matches!(
            d.next(Duration::ZERO).await,
            Some(Item::EndOfEpoch(1))
        ));
        d.publish(2, Item::Done);
        assert!(matches!(d.next(Duration::ZERO).await, Some(Item::Done)));
        assert!(
            matches!(d.next(Duration::ZERO).await, Some(Item::Done)),
            "done repeats"
        );
    }
}
