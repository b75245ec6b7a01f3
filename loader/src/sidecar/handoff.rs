//! The unix socket the trainer talks to. Each `next` is answered with the next item in plan
//! order; the time the trainer spends blocked on it is the data wait the autoscaler reads.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::pipeline::{Item, Pipeline, count_delivered};
use super::plan::{Cursor, Shard};
use super::protocol::{HelloInfo, Reply, Request};

/// A `next` without a timeout waits this long before answering `timeout`, so that a client
/// always hears back and can tell a slow pipeline from a dead sidecar.
const DEFAULT_NEXT_TIMEOUT: Duration = Duration::from_secs(60);
/// Data wait is added to the counter at least this often during a long wait, so a stalled
/// trainer shows up in the metric while it is stalled, not only afterwards.
const WAIT_TICK: Duration = Duration::from_millis(500);

pub async fn serve(listener: UnixListener, pipeline: Arc<Pipeline>, hello: Arc<HelloInfo>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(stream, pipeline.clone(), hello.clone()));
            }
            Err(err) => {
                tracing::warn!(%err, "accepting a trainer connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn connection(stream: UnixStream, pipeline: Arc<Pipeline>, hello: Arc<HelloInfo>) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut held: HashSet<u32> = HashSet::new();
    loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(err) => {
                tracing::info!(%err, "trainer connection failed");
                break;
            }
        };
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Hello { rank, world_size }) => {
                Some(say_hello(&pipeline, &hello, rank, world_size))
            }
            Ok(Request::Seek {
                epoch,
                position,
                seed,
                batch_size,
                samples,
            }) => {
                // The trainer drops what it held: the stream starts again.
                for slot in held.drain() {
                    let _ = pipeline.ring.release(slot);
                }
                let checkpoint = Checkpoint {
                    from: Cursor {
                        epoch,
                        position: position as usize,
                    },
                    seed,
                    batch_size: u64::from(batch_size),
                    samples,
                };
                Some(seek(&pipeline, &checkpoint))
            }
            Ok(Request::Next { timeout_ms }) => {
                let wait = timeout_ms.map_or(DEFAULT_NEXT_TIMEOUT, Duration::from_millis);
                Some(next(&pipeline, wait, &mut held).await)
            }
            Ok(Request::Release { slot }) => {
                if held.remove(&slot) {
                    if let Err(err) = pipeline.ring.release(slot) {
                        tracing::warn!(%err, "release");
                    }
                } else {
                    tracing::warn!(slot, "trainer released a slot it does not hold");
                }
                None
            }
            Err(err) => Some(Reply::Error {
                message: format!("bad request: {err}"),
            }),
        };
        if let Some(reply) = reply {
            let mut text = serde_json::to_string(&reply).unwrap_or_else(|e| {
                format!("{{\"type\":\"error\",\"message\":\"encoding reply: {e}\"}}")
            });
            text.push('\n');
            if let Err(err) = write.write_all(text.as_bytes()).await {
                tracing::info!(%err, "trainer went away");
                break;
            }
        }
    }
    // A trainer that disconnects gives its slots back, so a restarted trainer process does
    // not find the ring full.
    for slot in held {
        let _ = pipeline.ring.release(slot);
    }
}

async fn next(pipeline: &Pipeline, wait: Duration, held: &mut HashSet<u32>) -> Reply {
    let start = Instant::now();
    let mut counted = Duration::ZERO;
    let item = loop {
        let left = wait.saturating_sub(start.elapsed());
        let got = pipeline.delivery.next(left.min(WAIT_TICK)).await;
        let waited = start.elapsed();
        pipeline
            .metrics
            .data_wait(pipeline.shard().rank)
            .inc_by((waited - counted).as_secs_f64());
        counted = waited;
        if got.is_some() || waited >= wait {
            break got;
        }
    };
    match item {
        Some(Item::Batch(header)) => {
            held.insert(header.slot);
            count_delivered(&pipeline.metrics, &header);
            Reply::Batch(header)
        }
        Some(Item::EndOfEpoch(epoch)) => Reply::EndOfEpoch { epoch },
        Some(Item::Done) => Reply::Done,
        Some(Item::SourceUnavailable(message)) => Reply::SourceUnavailable { message },
        None => Reply::Timeout,
    }
}

/// Answers `hello` with the ring and where the stream stands. A rank or world size the trainer
/// says that is not the stream's restarts the stream at the start point for that rank.
fn say_hello(
    pipeline: &Arc<Pipeline>,
    base: &HelloInfo,
    rank: Option<u32>,
    world_size: Option<u32>,
) -> Reply {
    let current = pipeline.shard();
    let asked = Shard {
        rank: rank.unwrap_or(current.rank),
        world_size: world_size.unwrap_or(current.world_size),
    };
    if asked != current || !pipeline.started() {
        if let Err(err) = pipeline.restart(asked, pipeline.start) {
            return Reply::Error {
                message: format!("rank {} of {}: {err}", asked.rank, asked.world_size),
            };
        }
        tracing::info!(
            rank = asked.rank,
            world_size = asked.world_size,
            "trainer's rank"
        );
    }
    let standing = pipeline.delivery.standing();
    Reply::Hello(HelloInfo {
        rank: asked.rank,
        world_size: asked.world_size,
        batches_per_epoch: pipeline.batches_per_epoch(),
        epoch: standing.epoch,
        position: standing.position as u64,
        ..base.clone()
    })
}

/// A trainer checkpoint's resume point and the order it belongs to.
struct Checkpoint {
    from: Cursor,
    seed: u64,
    batch_size: u64,
    samples: u64,
}

/// Restarts the stream at a checkpoint, if the checkpoint is of this pipeline's order.
fn seek(pipeline: &Arc<Pipeline>, checkpoint: &Checkpoint) -> Reply {
    let mismatch = [
        ("seed", checkpoint.seed, pipeline.plan.seed),
        (
            "batch_size",
            checkpoint.batch_size,
            pipeline.plan.batch_size as u64,
        ),
        ("samples", checkpoint.samples, pipeline.samples.len() as u64),
    ]
    .into_iter()
    .find(|(_, theirs, ours)| theirs != ours);
    if let Some((field, theirs, ours)) = mismatch {
        return Reply::Error {
            message: format!(
                "the checkpoint's {field} is {theirs} but this pipeline's is {ours}: it belongs to another order"
            ),
        };
    }
    if checkpoint.from.position as u64 > checkpoint.samples {
        return Reply::Error {
            message: format!(
                "the checkpoint's position {} is past the epoch's {} samples",
                checkpoint.from.position, checkpoint.samples
            ),
        };
    }
    match pipeline.restart(pipeline.shard(), checkpoint.from) {
        Ok(batches) => {
            tracing::info!(
                epoch = checkpoint.from.epoch,
                position = checkpoint.from.position,
                batches,
                "trainer resumed"
            );
            Reply::Seeked {
                epoch: checkpoint.from.epoch,
                position: checkpoint.from.position as u64,
                batches,
            }
        }
        Err(err) => Reply::Error {
            message: err.to_string(),
        },
    }
}
