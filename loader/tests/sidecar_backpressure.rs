//! A trainer that stops consuming: the sidecar fills its ring, then stops requesting batches,
//! and its resident memory stays flat.

mod sidecar_support;

use std::time::Duration;

use sidecar_support::*;
use stoker_loader::sidecar::protocol::Reply;
use stoker_testenv::http;
use stoker_testenv::s3::S3Server;

#[test]
fn a_paused_trainer_stops_requests_and_memory_stays_flat() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    dataset(&server, 200, 320, 240);
    let w = decode_worker(&server);
    let sc = sidecar(
        &server,
        dir.path(),
        &[&w],
        &[
            "--width",
            "224",
            "--height",
            "224",
            "--batch-size",
            "8",
            "--prefetch-batches",
            "4",
        ],
    );
    let mut c = sc.connect();
    for _ in 0..3 {
        let Reply::Batch(b) = c.next(Duration::from_secs(30)).unwrap() else {
            panic!()
        };
        c.release(b.slot).unwrap();
    }
    // The trainer holds nothing and asks for nothing: the ring fills, all 4 + 2 slots (prefetch
    // depth plus the batches a trainer may hold).
    wait_until("the ring to fill", Duration::from_secs(30), || {
        sc.metric("stoker_sidecar_ready_batches") >= 6.0
            && sc.metric("stoker_sidecar_inflight_batches") == 0.0
    });
    std::thread::sleep(Duration::from_secs(2));
    let worker_metrics = || http::blocking::get(w.http, "/metrics").unwrap().1;
    let requested_before = metric(&worker_metrics(), "stoker_loader_samples_in_total");
    let rss_before = rss_kib(sc.proc.pid());
    let mut peak = rss_before;
    for _ in 0..30 {
        std::thread::sleep(Duration::from_secs(1));
        peak = peak.max(rss_kib(sc.proc.pid()));
    }
    let rss_after = rss_kib(sc.proc.pid());
    let requested_after = metric(&worker_metrics(), "stoker_loader_samples_in_total");
    eprintln!(
        "sidecar VmRSS: {rss_before} KiB before the 30 s pause, peak {peak} KiB, {rss_after} KiB after"
    );
    assert_eq!(
        requested_after, requested_before,
        "no batch was requested while the trainer paused"
    );
    assert!(
        peak <= rss_before + 2048,
        "resident memory grew from {rss_before} KiB to {peak} KiB during the pause"
    );
    assert_eq!(sc.metric("stoker_sidecar_ready_batches"), 6.0);
    // The trainer resumes and the pipeline continues.
    for _ in 0..6 {
        let Reply::Batch(b) = c.next(Duration::from_secs(30)).unwrap() else {
            panic!()
        };
        c.release(b.slot).unwrap();
    }
}
