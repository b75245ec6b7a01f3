//! A corpus of bad files through a real worker: each is skipped with the right reason, the
//! worker keeps serving, and a decompression bomb does not cost memory.

mod common;

use common::*;
use stoker_loader::proto;
use stoker_testenv::s3::S3Server;

fn png_bomb(w: u32, h: u32) -> Vec<u8> {
    // A valid signature and IHDR claiming w x h RGB, then one tiny IDAT and IEND.
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(
        &mut out,
        b"IDAT",
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    );
    chunk(&mut out, b"IEND", &[]);
    out
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&[0, 0, 0, 0]); // CRC: the size guard runs before any CRC check
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn by_key(key: &str) -> proto::SampleRef {
    proto::SampleRef {
        key: key.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn bad_files_are_skipped_with_their_reason_and_the_worker_keeps_serving() {
    let good = jpeg(640, 480);
    let mut truncated = good.clone();
    truncated.truncate(good.len() / 2);
    // Flip bits throughout the entropy-coded data and the Huffman tables.
    let mut flipped = good.clone();
    let sos = flipped.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let dht = flipped.windows(2).position(|w| w == [0xFF, 0xC4]).unwrap();
    for b in &mut flipped[dht + 5..dht + 21] {
        *b ^= 0xFF;
    }
    for i in (sos + 20..flipped.len() - 2).step_by(97) {
        flipped[i] ^= 0x5A;
    }
    let mut png_truncated = png(300, 200);
    png_truncated.truncate(png_truncated.len() / 2);
    let html = b"<!DOCTYPE html><html><head><title>503 Service Unavailable</title></head><body>Try again</body></html>".to_vec();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("truncated.jpg", truncated, "truncated"),
        ("flipped.jpg", flipped, "corrupt"),
        ("empty.jpg", Vec::new(), "empty"),
        ("error.html", html, "unsupported"),
        (
            "notes.txt",
            b"just some text, not an image\n".to_vec(),
            "unsupported",
        ),
        ("bomb.png", png_bomb(60000, 60000), "too_large"),
        ("truncated.png", png_truncated, "truncated"),
        (
            "gif.gif",
            b"GIF89a\x01\x00\x01\x00\x00\x00\x00;".to_vec(),
            "unsupported",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    for (key, data, _) in &cases {
        server.put_object(BUCKET, key, data).unwrap();
    }
    server.put_object(BUCKET, "good.jpg", &good).unwrap();
    let mut w = worker(Some(&server), 2).await;
    let mut samples: Vec<proto::SampleRef> = cases.iter().map(|(k, _, _)| by_key(k)).collect();
    samples.push(by_key("good.jpg"));
    let req = proto::DecodeBatchRequest {
        batch_id: 1,
        bucket: BUCKET.into(),
        samples,
        transform: Some(crop(224, 224)),
    };
    let reply = w
        .client
        .decode_batch(req)
        .await
        .expect("the batch itself succeeds");
    for ((key, _, reason), m) in cases.iter().zip(&reply.samples) {
        assert_eq!(&m.key, key);
        assert_eq!(m.skip_reason, *reason, "{key}");
        assert_eq!((m.width, m.height), (0, 0), "{key}");
    }
    let last = reply.samples.last().unwrap();
    assert_eq!(last.skip_reason, "");
    assert_eq!(last.offset, 0, "skipped samples take no room");
    assert_eq!(reply.pixels.len(), 224 * 224 * 3);

    // Many bombs at once: no allocation of their claimed size (60000² x 3 = 10 GB each).
    let before = rss_kib();
    // Inline bytes take the same path minus the GET.
    let bombs: Vec<proto::SampleRef> = (0..64)
        .map(|i| proto::SampleRef {
            key: format!("bomb{i}.png"),
            metadata: String::new(),
            inline: png_bomb(60000, 60000).into(),
            ..Default::default()
        })
        .collect();
    let reply = w
        .client
        .decode_batch(proto::DecodeBatchRequest {
            batch_id: 2,
            bucket: BUCKET.into(),
            samples: bombs,
            transform: Some(crop(224, 224)),
        })
        .await
        .unwrap();
    assert!(reply.samples.iter().all(|m| m.skip_reason == "too_large"));
    let grown_mib = rss_kib().saturating_sub(before) / 1024;
    assert!(grown_mib < 256, "RSS grew by {grown_mib} MiB");

    // Still serving good batches afterwards.
    let reply = w
        .client
        .decode_batch(proto::DecodeBatchRequest {
            batch_id: 3,
            bucket: BUCKET.into(),
            samples: vec![by_key("good.jpg")],
            transform: Some(crop(224, 224)),
        })
        .await
        .unwrap();
    assert_eq!(reply.samples[0].skip_reason, "");
    let text = metrics_text(&w).await;
    assert_eq!(
        metric(&text, "stoker_loader_skips_total{reason=\"too_large\"}"),
        65.0
    );
    assert_eq!(
        metric(&text, "stoker_loader_skips_total{reason=\"unsupported\"}"),
        3.0
    );
    assert_eq!(metric(&text, "stoker_loader_samples_out_total"), 2.0);
}

/// A 5 GB object (sparse on the S3 server's disk) named as a sample: skipped as `too_large`
/// from its Content-Length within seconds, no byte of its body held; the batch's good sample
/// is still decoded.
#[tokio::test]
async fn an_object_over_the_byte_budget_is_skipped_unread() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server
        .put_object(BUCKET, "good.jpg", &jpeg(320, 240))
        .unwrap();
    server
        .put_sparse_object(BUCKET, "huge.jpg", 5 << 30)
        .unwrap();
    let mut w = worker(Some(&server), 2).await;
    let before = rss_kib();
    let started = std::time::Instant::now();
    let reply = w
        .client
        .decode_batch(proto::DecodeBatchRequest {
            batch_id: 1,
            bucket: BUCKET.into(),
            samples: vec![by_key("huge.jpg"), by_key("good.jpg")],
            transform: Some(crop(224, 224)),
        })
        .await
        .expect("the batch itself succeeds");
    let took = started.elapsed();
    let grown_mib = rss_kib().saturating_sub(before) / 1024;
    let reasons: Vec<&str> = reply
        .samples
        .iter()
        .map(|m| m.skip_reason.as_str())
        .collect();
    assert_eq!(reasons, ["too_large", ""]);
    assert_eq!(reply.pixels.len(), 224 * 224 * 3);
    assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
    assert!(
        grown_mib < 64,
        "RSS grew by {grown_mib} MiB for a 5 GB object"
    );
    eprintln!("5 GB object refused in {took:?}, RSS +{grown_mib} MiB");
}
