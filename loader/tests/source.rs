//! The S3 source against a real S3 server on loopback (s3s-fs, signatures checked).

mod common;

use common::*;
use stoker_loader::source::ManifestLocation;
use stoker_testenv::s3::S3Server;

#[tokio::test]
async fn listing_follows_pagination_and_skips_folder_markers() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    for i in 0..23 {
        server
            .put_object(BUCKET, &format!("train/{i:03}.jpg"), b"x")
            .unwrap();
    }
    server
        .put_object(BUCKET, "other/elsewhere.jpg", b"x")
        .unwrap();
    let (source, metrics) = source(&server).await;
    let keys = source.list(BUCKET, "train/", 5).await.unwrap();
    let names: Vec<String> = keys.iter().map(|s| s.key.clone()).collect();
    let want: Vec<String> = (0..23).map(|i| format!("train/{i:03}.jpg")).collect();
    assert_eq!(names, want, "every key under the prefix, once, in order");
    // 23 keys at 5 per page: 5 pages.
    let text = metrics.encode();
    assert_eq!(
        metric(
            &text,
            "stoker_loader_s3_requests_total{op=\"list_objects_v2\"}"
        ),
        5.0
    );
}

#[tokio::test]
async fn manifest_metadata_reaches_the_reply_and_missing_objects_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server
        .put_object(BUCKET, "img/a.jpg", &jpeg(320, 240))
        .unwrap();
    server
        .put_object(BUCKET, "img/b.png", &png(200, 300))
        .unwrap();
    let manifest = concat!(
        "{\"key\":\"img/a.jpg\",\"caption\":\"a red square\",\"label\":7}\n",
        "{\"key\":\"img/missing.jpg\",\"caption\":\"gone\"}\n",
        "{\"key\":\"img/b.png\",\"caption\":\"tall\"}\n",
    );
    server
        .put_object(BUCKET, "train.jsonl", manifest.as_bytes())
        .unwrap();
    let local = dir.path().join("local.jsonl");
    std::fs::write(&local, manifest).unwrap();

    let (source, _) = source(&server).await;
    let from_s3 = source
        .load_manifest(&ManifestLocation::parse(&format!(
            "s3://{BUCKET}/train.jsonl"
        )))
        .await
        .unwrap();
    let from_disk = source
        .load_manifest(&ManifestLocation::parse(local.to_str().unwrap()))
        .await
        .unwrap();
    assert_eq!(from_s3, from_disk);
    assert_eq!(from_s3.len(), 3);

    let mut w = worker(Some(&server), 2).await;
    let req = stoker_loader::proto::DecodeBatchRequest {
        batch_id: 9,
        bucket: BUCKET.into(),
        samples: from_s3
            .iter()
            .map(|s| stoker_loader::proto::SampleRef {
                key: s.key.clone(),
                metadata: s.metadata.clone(),
                ..Default::default()
            })
            .collect(),
        transform: Some(crop(64, 64)),
    };
    let reply = w.client.decode_batch(req).await.unwrap();
    assert_eq!(reply.batch_id, 9);
    let s = &reply.samples;
    assert_eq!(s.len(), 3);
    let meta: serde_json::Value = serde_json::from_str(&s[0].metadata).unwrap();
    assert_eq!(meta["caption"], "a red square");
    assert_eq!(meta["label"], 7);
    assert_eq!((s[0].orig_width, s[0].orig_height), (320, 240));
    assert_eq!(s[1].skip_reason, "not_found");
    assert_eq!(s[1].key, "img/missing.jpg");
    assert!(
        s[1].metadata.contains("gone"),
        "metadata travels with skipped samples too"
    );
    assert_eq!(s[2].skip_reason, "");
    assert_eq!((s[2].orig_width, s[2].orig_height), (200, 300));
    assert_eq!(reply.pixels.len(), 2 * 64 * 64 * 3);
    assert_eq!(s[2].offset, 64 * 64 * 3);

    let text = metrics_text(&w).await;
    assert_eq!(
        metric(&text, "stoker_loader_skips_total{reason=\"not_found\"}"),
        1.0
    );
    assert_eq!(metric(&text, "stoker_loader_samples_out_total"), 2.0);
}

#[tokio::test]
async fn throttling_then_recovery_loses_no_sample() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    let keys: Vec<String> = (0..12).map(|i| format!("t/{i}.jpg")).collect();
    for k in &keys {
        server.put_object(BUCKET, k, &jpeg(128, 96)).unwrap();
    }
    let mut w = worker(Some(&server), 2).await;
    // 40 failures in a row, a mix of SlowDown and plain 500s, then the server recovers.
    server.fail_next(30, 503);
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let first = w
        .client
        .decode_batch(request(&refs, crop(32, 32)))
        .await
        .unwrap();
    server.fail_next(10, 500);
    let second = w
        .client
        .decode_batch(request(&refs, crop(32, 32)))
        .await
        .unwrap();
    for reply in [&first, &second] {
        assert!(
            reply.samples.iter().all(|s| s.skip_reason.is_empty()),
            "{:?}",
            reply.samples
        );
        assert_eq!(reply.pixels.len(), 12 * 32 * 32 * 3);
    }
    assert_eq!(server.failures_injected(), 40);
    let text = metrics_text(&w).await;
    assert_eq!(metric(&text, "stoker_loader_s3_throttles_total"), 30.0);
    assert_eq!(metric(&text, "stoker_loader_s3_retries_total"), 40.0);
    assert_eq!(metric(&text, "stoker_loader_samples_out_total"), 24.0);
}
