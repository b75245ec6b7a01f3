//! SIGTERM during load, on the real `stoker-loader decode` binary: batches in flight complete,
//! new ones are refused, readiness turns 503, and the process exits cleanly.

mod common;

use std::time::{Duration, Instant};

use common::*;
use stoker_loader::worker::DecodeClient;
use stoker_testenv::s3::S3Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_inflight_batches_and_refuses_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    // A large PNG makes each batch take a while, so SIGTERM lands mid-batch.
    server
        .put_object(BUCKET, "big.png", &png(800, 600))
        .unwrap();
    server
        .put_object(BUCKET, "small.jpg", &jpeg(64, 48))
        .unwrap();

    let mut decoder = spawn_decoder(&server, &["--threads", "2", "--queue-depth", "8"]);
    let (grpc, http) = (decoder.grpc, decoder.http);
    assert_eq!(
        stoker_testenv::http::get(http, "/readyz").await.unwrap().0,
        200
    );

    let client = DecodeClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let keys = ["big.png"; 12];
    let inflight: Vec<_> = (0..3)
        .map(|_| {
            let mut c = client.clone();
            let req = request(&keys, crop(224, 224));
            tokio::spawn(async move { c.decode_batch(req).await })
        })
        .collect();
    // Wait until all three are admitted (samples are counted at admission), so that each is
    // either in flight or done when SIGTERM lands.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = stoker_testenv::http::get(http, "/metrics").await.unwrap().1;
        if metric(&text, "stoker_loader_samples_in_total") >= 36.0 {
            assert!(
                metric(&text, "stoker_loader_inflight_batches") >= 1.0,
                "SIGTERM must land while batches are in flight"
            );
            break;
        }
        assert!(Instant::now() < deadline, "batches never became in flight");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    unsafe {
        libc::kill(decoder.child.id() as i32, libc::SIGTERM);
    }
    // Draining: readiness fails and a new batch is refused.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stoker_testenv::http::get(http, "/readyz").await.unwrap().0 != 503 {
        assert!(Instant::now() < deadline, "readiness never turned 503");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut late = client.clone();
    let refused = late
        .decode_batch(request(&["small.jpg"], crop(32, 32)))
        .await;
    let status = refused.expect_err("a batch sent while draining is refused");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");

    for task in inflight {
        let reply = task.await.unwrap().expect("in-flight batch completes");
        assert_eq!(reply.samples.len(), 12);
        assert!(reply.samples.iter().all(|s| s.skip_reason.is_empty()));
        assert_eq!(reply.pixels.len(), 12 * 224 * 224 * 3);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = decoder.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "worker did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "exit status {status:?}");
}
