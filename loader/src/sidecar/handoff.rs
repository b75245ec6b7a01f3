//! The unix socket the trainer talks to. Each `next` is answered with the next item in plan
//! order; the time the trainer spends blocked on it is the data wait the autoscaler reads.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::pipeline::{Item, Pipeline, count_delivered};
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
            Ok(Request::Hello) => Some(Reply::Hello((*hello).clone())),
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
            .data_wait(pipeline.plan.shard.rank)
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
        None => Reply::Timeout,
    }
}
