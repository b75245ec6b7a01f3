//! WebDataset shards end to end: shards written by the Python `webdataset` package into the
//! real S3 server, indexed by the `stoker-loader index` process, planned per rank with the
//! shard-aware shuffle, and decoded by a real decode worker from coalesced range GETs.

mod common;
mod sidecar_support;

use std::collections::HashSet;

use common::*;
use sidecar_support::{decode_worker, sidecar};
use stoker_loader::index::{ShardTable, build_webdataset, resolve_shards};
use stoker_loader::sidecar::client::TrainerClient;
use stoker_loader::sidecar::plan::{Cursor, PlanConfig};
use stoker_loader::sidecar::protocol::Reply;
use stoker_loader::source::ManifestLocation;
use stoker_testenv::s3::S3Server;

const INDEX_BUCKET: &str = "index";

/// Writes `shards` shards of `per` samples: a small JPEG, a `.txt` caption and a `.cls` label,
/// with the `webdataset` package's own TarWriter.
const WRITE_SHARDS: &str = r#"
import io, sys
import webdataset as wds
from PIL import Image
out, shards, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for s in range(shards):
    with wds.TarWriter(f"{out}/{s:05d}.tar") as w:
        for i in range(per):
            n = s * per + i
            img = Image.new("RGB", (24 + n % 17, 16 + n % 13), ((n * 37) % 256, (n * 91) % 256, (n * 53) % 256))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=80)
            w.write({"__key__": f"s{n:07d}", "jpg": buf.getvalue(), "txt": f"caption {n}", "cls": n % 10})
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sample_once_across_four_ranks_with_captions_labels_and_a_truncated_shard() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    let (shards, per) = (6, 50);
    write_with_python(&server, WRITE_SHARDS, "wds", shards, per);

    // The index, built by its own process into a bucket apart from the data.
    let summary = index_process(
        &server,
        &[
            "--shards",
            &format!("s3://{BUCKET}/wds/{{00000..{:05}}}.tar", shards - 1),
            "--out",
            &format!("s3://{INDEX_BUCKET}/pipe/"),
        ],
    );
    assert_eq!(summary["shards"], shards);
    assert_eq!(summary["samples"], shards * per);
    assert_eq!(summary["problems"], 0);
    eprintln!("index: {summary}");

    // The last shard loses its tail after indexing: the samples past the cut are skipped
    // with their shard, range and reason; the shard's other samples still arrive.
    let last = server.root().join(BUCKET).join("wds/00005.tar");
    let bytes = std::fs::read(&last).unwrap();
    let cut = bytes.len() * 3 / 5;
    std::fs::write(&last, &bytes[..cut]).unwrap();

    let (source, _) = source(&server).await;
    let location = ManifestLocation::parse(&format!("s3://{INDEX_BUCKET}/pipe/"));
    let table = ShardTable::load(&source, location).await.unwrap();
    assert_eq!(table.counts, vec![per as u32; shards]);

    let mut worker = worker(Some(&server), 2).await;
    let mut delivered = Vec::new();
    let mut batches = 0usize;
    for rank in 0..4 {
        for batch in shard_plan(rank, 4, 16).shard_plan_from(&table.counts, 120, Cursor::default())
        {
            delivered
                .extend(decode_shard_samples(&mut worker, &table, &source, &batch.samples).await);
            batches += 1;
        }
    }
    let gets = get_requests(&worker);
    let n = shards * per;
    assert_eq!(delivered.len(), n, "300 divides by 4 ranks: no padding");
    let mut seen = HashSet::new();
    let mut skipped = Vec::new();
    for d in &delivered {
        if !d.skip.is_empty() {
            assert_eq!(
                d.shard_key, "wds/00005.tar",
                "only the cut shard loses samples"
            );
            assert_eq!(d.skip, "truncated");
            let range = d.metadata["__range__"]
                .as_str()
                .expect("a skip names its range");
            let end: usize = range.split('-').nth(1).unwrap().parse().unwrap();
            assert!(
                end > cut,
                "skipped sample {range} lies before the cut at {cut}"
            );
            skipped.push(range.to_string());
            continue;
        }
        let key = d.metadata["__key__"].as_str().unwrap().to_string();
        let number: usize = key[1..].parse().unwrap();
        assert_eq!(d.metadata["caption"], format!("caption {number}"));
        assert_eq!(d.metadata["label"], number % 10);
        assert_eq!(d.shard_key, format!("wds/{:05}.tar", number / per));
        assert_eq!(d.width, 16);
        assert!(seen.insert(key), "a sample delivered twice");
    }
    assert!(
        !skipped.is_empty() && skipped.len() < per,
        "{} skipped",
        skipped.len()
    );
    assert_eq!(
        seen.len() + skipped.len(),
        n,
        "every sample once: delivered or skipped"
    );
    eprintln!(
        "{n} samples in {batches} batches: {gets} range GETs ({:.2} per sample), {} skipped",
        gets / n as f64,
        skipped.len()
    );
    assert!(gets <= n as f64, "never more than one GET per sample");

    // Without shuffling a batch is one run of neighbours: one GET per batch.
    let before = get_requests(&worker);
    let ordered = PlanConfig {
        shuffle: false,
        ..shard_plan(0, 1, 25)
    };
    let first = ordered
        .shard_plan_from(&table.counts, 120, Cursor::default())
        .next()
        .unwrap();
    let got = decode_shard_samples(&mut worker, &table, &source, &first.samples).await;
    assert!(got.iter().all(|d| d.skip.is_empty()));
    assert_eq!(
        get_requests(&worker) - before,
        1.0,
        "25 neighbours in one range GET"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_mid_shard_decodes_the_remaining_order_and_a_cut_shard_is_reported_at_index_time()
{
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    write_with_python(&server, WRITE_SHARDS, "wds", 3, 40);
    // Truncated before indexing: the index keeps the complete samples and says what it left.
    let last = server.root().join(BUCKET).join("wds/00002.tar");
    let bytes = std::fs::read(&last).unwrap();
    std::fs::write(&last, &bytes[..bytes.len() / 2]).unwrap();

    let (source, _) = source(&server).await;
    let (bucket, keys) = resolve_shards(&source, &format!("s3://{BUCKET}/wds/"), ".tar")
        .await
        .unwrap();
    assert_eq!(keys.len(), 3, "every .tar under the prefix");
    let (index, offsets) = build_webdataset(&source, &bucket, &keys, 2).await.unwrap();
    assert_eq!(index.shards[0].samples, 40);
    let kept = index.shards[2].samples;
    assert!(
        kept > 10 && kept < 40,
        "{kept} samples kept of the cut shard"
    );
    assert_eq!(index.problems.len(), 1);
    assert_eq!(index.problems[0].key, "wds/00002.tar");
    assert!(
        index.problems[0].reason.contains("truncated"),
        "{:?}",
        index.problems
    );

    let out = dir.path().join("index");
    stoker_loader::index::write_index(
        &source,
        &ManifestLocation::File(out.clone()),
        &index,
        offsets,
    )
    .await
    .unwrap();
    let table = ShardTable::load(&source, ManifestLocation::File(out))
        .await
        .unwrap();
    let mut worker = worker(Some(&server), 2).await;

    // Rank 1 of 2: the whole epoch, then a restart from the checkpoint after batch 3 (mid
    // shard): the remaining batches decode to the same samples in the same order.
    let keys_of = |d: Vec<Delivered>| -> Vec<String> {
        d.into_iter()
            .map(|d| {
                assert!(d.skip.is_empty(), "{d:?}");
                d.metadata["__key__"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let full: Vec<_> = shard_plan(1, 2, 8)
        .shard_plan_from(
            &table.counts,
            30,
            Cursor {
                epoch: 3,
                position: 0,
            },
        )
        .collect();
    let mut full_keys = Vec::new();
    for b in &full {
        full_keys.push(keys_of(
            decode_shard_samples(&mut worker, &table, &source, &b.samples).await,
        ));
    }
    let position = full[2].position;
    let resumed: Vec<_> = shard_plan(1, 2, 8)
        .shard_plan_from(&table.counts, 30, Cursor { epoch: 3, position })
        .collect();
    let mut resumed_keys = Vec::new();
    for b in &resumed {
        resumed_keys.push(keys_of(
            decode_shard_samples(&mut worker, &table, &source, &b.samples).await,
        ));
    }
    assert_eq!(resumed_keys, full_keys[3..], "the remaining order, exactly");
}

/// Like [`WRITE_SHARDS`] at scale: a few tiny JPEGs encoded once, and a `.cls` label, so that
/// 200,000 samples take ~2 KiB each (tar's 512-byte blocks) and a few seconds to write.
const WRITE_MANY_SHARDS: &str = r#"
import io, sys
import webdataset as wds
from PIL import Image
out, shards, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jpegs = []
for c in range(16):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (c * 16, 255 - c * 16, 128)).save(buf, format="JPEG", quality=50)
    jpegs.append(buf.getvalue())
for s in range(shards):
    with wds.TarWriter(f"{out}/{s:05d}.tar") as w:
        for i in range(per):
            n = s * per + i
            w.write({"__key__": f"s{n:07d}", "jpg": jpegs[n % 16], "cls": n % 1000})
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_thousand_samples_plan_in_o_shards_memory_and_the_first_batch_is_fast() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    let (shards, per) = (20usize, 10_000usize);
    let t = std::time::Instant::now();
    write_with_python(&server, WRITE_MANY_SHARDS, "big", shards, per);
    eprintln!(
        "wrote {} samples in {:.1} s",
        shards * per,
        t.elapsed().as_secs_f64()
    );

    let summary = index_process(
        &server,
        &[
            "--shards",
            &format!("s3://{BUCKET}/big/{{00000..{:05}}}.tar", shards - 1),
            "--out",
            &format!("s3://{INDEX_BUCKET}/big/"),
        ],
    );
    assert_eq!(summary["samples"], shards * per);
    eprintln!("index of {} samples: {summary}", shards * per);

    // The first batch as a sidecar would get it: load the summary, plan, read one shard's
    // offsets, decode.
    let (source, _) = source(&server).await;
    let mut worker = worker(Some(&server), 2).await;
    let t0 = std::time::Instant::now();
    let location = ManifestLocation::parse(&format!("s3://{INDEX_BUCKET}/big/"));
    let table = ShardTable::load(&source, location).await.unwrap();
    let window = stoker_loader::sidecar::plan::DEFAULT_SHUFFLE_WINDOW;
    let mut batches =
        shard_plan(3, 8, 32).shard_plan_from(&table.counts, window, Cursor::default());
    let first = batches.next().unwrap();
    let got = decode_shard_samples(&mut worker, &table, &source, &first.samples).await;
    let first_batch = t0.elapsed();
    assert_eq!(got.len(), 32);
    assert!(got.iter().all(|d| d.skip.is_empty()));
    assert_eq!(batches.len(), (shards * per).div_ceil(8).div_ceil(32));

    // The plan's memory: the shard table and the order, O(shards), plus the window.
    let plan_bytes = table.resident_bytes() + batches.state_bytes();
    let bound = 128 * shards + 8 * window + 1024;
    eprintln!(
        "first batch {:.0} ms; plan state {plan_bytes} bytes for {} samples in {shards} shards (bound {bound})",
        first_batch.as_secs_f64() * 1e3,
        shards * per
    );
    assert!(plan_bytes <= bound, "{plan_bytes} > {bound}");
}

/// The real sidecar process planning over the index, as the operator starts it for a
/// `webDataset` source: two ranks (two sidecars, as two pods), one decode worker process, a
/// trainer per rank. Every sample arrives once per epoch across the ranks with its caption and
/// label, a batch resumed mid-epoch continues the same order, and the next epoch is reshuffled.
#[test]
fn sidecars_over_the_index_deliver_every_sample_once_per_epoch_and_resume_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    let (shards, per) = (4, 30);
    write_with_python(&server, WRITE_SHARDS, "wds", shards, per);
    index_process(
        &server,
        &[
            "--shards",
            &format!("s3://{BUCKET}/wds/"),
            "--out",
            &format!("s3://{INDEX_BUCKET}/pipe/"),
        ],
    );
    let worker = decode_worker(&server);
    let start = |rank: u32, extra: &[&str]| {
        let rank = rank.to_string();
        let mut flags = vec![
            "--index",
            "s3://index/pipe/",
            "--shuffle-window",
            "40",
            "--rank",
            &rank,
            "--world-size",
            "2",
            "--batch-size",
            "8",
        ];
        flags.extend_from_slice(extra);
        sidecar(&server, dir.path(), &[&worker], &flags)
    };

    // Two epochs on both ranks: (epoch, rank) -> the samples' keys in delivery order.
    let mut order = std::collections::BTreeMap::new();
    for rank in 0..2 {
        let sidecar = start(rank, &[]);
        let mut trainer = sidecar.connect();
        for epoch in 0..2u64 {
            order.insert((epoch, rank), epoch_keys(&mut trainer, epoch, per));
        }
    }
    let n = shards * per;
    for epoch in 0..2u64 {
        let all: Vec<&String> = (0..2).flat_map(|r| &order[&(epoch, r)]).collect();
        let distinct: HashSet<&String> = all.iter().copied().collect();
        assert_eq!(all.len(), n, "epoch {epoch}: {n} samples delivered");
        assert_eq!(distinct.len(), n, "epoch {epoch}: each sample once");
    }
    assert_ne!(
        order[&(0, 0)],
        order[&(1, 0)],
        "the second epoch is reshuffled"
    );

    // A sidecar resumed after 3 batches of epoch 0 delivers the rest of rank 0's order.
    let resumed = start(0, &["--start-batch", "3"]);
    let rest = epoch_keys(&mut resumed.connect(), 0, per);
    assert_eq!(rest, order[&(0, 0)][3 * 8..]);
}

/// The samples' keys of one epoch as a trainer receives them, checking each sample's caption,
/// label and shard.
fn epoch_keys(trainer: &mut TrainerClient, epoch: u64, per: usize) -> Vec<String> {
    let mut keys = Vec::new();
    loop {
        match trainer.next(std::time::Duration::from_secs(60)).unwrap() {
            Reply::Batch(b) => {
                assert_eq!(b.epoch, epoch);
                for s in &b.samples {
                    assert_eq!(s.skip, None, "{}", s.key);
                    let meta: serde_json::Value = serde_json::from_str(&s.metadata).unwrap();
                    let key = meta["__key__"].as_str().unwrap().to_string();
                    let number: usize = key[1..].parse().unwrap();
                    assert_eq!(meta["caption"], format!("caption {number}"));
                    assert_eq!(meta["label"], number % 10);
                    assert_eq!(s.key, format!("wds/{:05}.tar", number / per));
                    keys.push(key);
                }
                trainer.release(b.slot).unwrap();
            }
            Reply::EndOfEpoch { epoch: ended } => {
                assert_eq!(ended, epoch);
                return keys;
            }
            other => panic!("unexpected reply {other:?}"),
        }
    }
}

/// A measurement, not a check (run it by hand):
/// `STOKER_WDS_SAMPLES=1000000 cargo test -p stoker-loader --test webdataset -- --ignored
/// --nocapture first_batch_at_scale`. Writes the shards (10,000 samples each), times the
/// `index` process and the index's size, then starts a real sidecar over the index and times a
/// trainer's first batch from its `connect`, and reports the sidecar's RSS.
#[test]
#[ignore = "a measurement of minutes: run by hand"]
fn first_batch_at_scale() {
    let samples: usize = std::env::var("STOKER_WDS_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let per = 10_000usize;
    let shards = samples.div_ceil(per);
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    let t = std::time::Instant::now();
    write_with_python(&server, WRITE_MANY_SHARDS, "big", shards, per);
    eprintln!(
        "wrote {} samples in {shards} shards in {:.1} s",
        shards * per,
        t.elapsed().as_secs_f64()
    );

    let summary = index_process(
        &server,
        &[
            "--shards",
            &format!("s3://{BUCKET}/big/{{00000..{:05}}}.tar", shards - 1),
            "--out",
            &format!("s3://{INDEX_BUCKET}/big/"),
        ],
    );
    let index_dir = server.root().join(INDEX_BUCKET).join("big");
    let size = |name: &str| {
        std::fs::metadata(index_dir.join(name))
            .map(|m| m.len())
            .unwrap_or(0)
    };
    eprintln!(
        "index: {summary}; index.json {} bytes, offsets.bin {} bytes",
        size("index.json"),
        size("offsets.bin")
    );

    let worker = decode_worker(&server);
    let t = std::time::Instant::now();
    let rank = sidecar(
        &server,
        dir.path(),
        &[&worker],
        &[
            "--index",
            "s3://index/big/",
            "--batch-size",
            "32",
            "--world-size",
            "8",
            "--rank",
            "3",
        ],
    );
    eprintln!(
        "sidecar serving {:.0} ms after start (index loaded)",
        t.elapsed().as_secs_f64() * 1e3
    );
    let t = std::time::Instant::now();
    let mut trainer = rank.connect();
    match trainer.next(std::time::Duration::from_secs(120)).unwrap() {
        Reply::Batch(b) => assert_eq!(b.samples.len(), 32),
        other => panic!("unexpected reply {other:?}"),
    }
    eprintln!(
        "first batch {:.0} ms after connect; sidecar RSS {} KiB",
        t.elapsed().as_secs_f64() * 1e3,
        sidecar_support::rss_kib(rank.proc.pid())
    );
}

/// By hand: a simulated index of 10 M samples (1,000 shards of 10,000, offsets of 10 KB
/// samples, in a local directory: no shards behind it), to size the index and time what a
/// sidecar does with it before its first decode: load the summary, plan rank 3 of 8, range-read
/// the first batch's offsets. Its plan state is checked against the same O(shards) bound.
/// `cargo test -p stoker-loader --test webdataset -- --ignored --nocapture ten_million`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn ten_million_samples_simulated_index() {
    use stoker_loader::index::{DatasetIndex, INDEX_VERSION, IndexKind, ShardEntry, write_index};
    let (shards, per) = (1000usize, 10_000u32);
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    let (source, _) = source(&server).await;
    let mut offsets = Vec::with_capacity(shards * (per as usize + 1) * 8);
    let index = DatasetIndex {
        version: INDEX_VERSION,
        kind: IndexKind::WebDataset,
        bucket: BUCKET.into(),
        shards: (0..shards)
            .map(|s| {
                for i in 0..=u64::from(per) {
                    offsets.extend_from_slice(&(i * 10_240).to_le_bytes());
                }
                ShardEntry {
                    key: format!("laion/{s:05}.tar"),
                    samples: per,
                    bytes: u64::from(per) * 10_240,
                    table: None,
                }
            })
            .collect(),
        samples: shards as u64 * u64::from(per),
        problems: Vec::new(),
    };
    let at = dir.path().join("index");
    let location = ManifestLocation::parse(at.to_str().unwrap());
    write_index(&source, &location, &index, offsets)
        .await
        .unwrap();
    let size = |name: &str| std::fs::metadata(at.join(name)).unwrap().len();

    let t0 = std::time::Instant::now();
    let table = ShardTable::load(&source, location).await.unwrap();
    let loaded = t0.elapsed();
    let window = stoker_loader::sidecar::plan::DEFAULT_SHUFFLE_WINDOW;
    let mut batches =
        shard_plan(3, 8, 32).shard_plan_from(&table.counts, window, Cursor::default());
    let first = batches.next().unwrap();
    let refs = table.sample_refs(&source, &first.samples).await.unwrap();
    let resolved = t0.elapsed();
    assert_eq!(refs.len(), 32);
    let plan_bytes = table.resident_bytes() + batches.state_bytes();
    let bound = 128 * shards + 8 * window + 1024;
    eprintln!(
        "10 M samples: index.json {} bytes, offsets.bin {} bytes; summary loaded in {:.0} ms, \
         first batch planned and resolved {:.0} ms after the start; plan state {plan_bytes} \
         bytes (bound {bound})",
        size("index.json"),
        size("offsets.bin"),
        loaded.as_secs_f64() * 1e3,
        resolved.as_secs_f64() * 1e3,
    );
    assert!(plan_bytes <= bound, "{plan_bytes} > {bound}");
}
