//! A full admission queue answers RESOURCE_EXHAUSTED at once instead of buffering.

mod common;

use std::time::{Duration, Instant};

use common::*;
use stoker_testenv::s3::S3Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_pushes_back_and_admitted_work_completes() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server
        .put_object(BUCKET, "big.png", &png(800, 600))
        .unwrap();
    server
        .put_object(BUCKET, "small.jpg", &jpeg(64, 48))
        .unwrap();
    let w = worker_with_queue(Some(&server), 1, 1).await;

    let mut first = w.client.clone();
    let slow = tokio::spawn(async move {
        first
            .decode_batch(request(&["big.png"; 24], crop(224, 224)))
            .await
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.state.inflight() < 1 {
        assert!(Instant::now() < deadline, "first batch never admitted");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let t0 = Instant::now();
    let mut second = w.client.clone();
    let refused = second
        .decode_batch(request(&["small.jpg"], crop(32, 32)))
        .await
        .expect_err("no room for a second batch");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "refused at once, not queued"
    );

    let reply = slow.await.unwrap().expect("the admitted batch completes");
    assert!(reply.samples.iter().all(|s| s.skip_reason.is_empty()));
    // Room again once it is done.
    let again = second
        .decode_batch(request(&["small.jpg"], crop(32, 32)))
        .await
        .unwrap();
    assert_eq!(again.samples[0].skip_reason, "");
    let text = metrics_text(&w).await;
    assert_eq!(
        metric(
            &text,
            "stoker_loader_rejected_batches_total{reason=\"queue_full\"}"
        ),
        1.0
    );
}
