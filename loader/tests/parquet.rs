//! Parquet files end to end: files written by `pyarrow` (Hugging Face's `Image` struct and a
//! plain binary column; dictionary-encoded snappy, plain zstd with v2 pages, uncompressed,
//! gzip) in the real S3 server, indexed by the `stoker-loader index` process, planned per rank
//! with the shard-aware shuffle, and decoded by a real decode worker from page range GETs.

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use stoker_loader::index::ShardTable;
use stoker_loader::index::parquet::FileTable;
use stoker_loader::sidecar::plan::Cursor;
use stoker_loader::source::ManifestLocation;
use stoker_testenv::s3::S3Server;

const INDEX_BUCKET: &str = "index";

/// Writes `files` files of `per` rows: a small JPEG (its width encodes the row), a caption and
/// a label, in row groups of 20 and pages of about two images. Each file has other writer
/// settings, as datasets in the wild do.
const WRITE_FILES: &str = r#"
import io, sys
import pyarrow as pa, pyarrow.parquet as pq
from PIL import Image
out, files, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
settings = [
    dict(compression="snappy"),  # pyarrow's defaults: dictionary-encoded, v1 pages
    dict(compression="zstd", use_dictionary=False, data_page_version="2.0"),
    dict(compression="none", use_dictionary=False),
    dict(compression="gzip", use_dictionary=["caption"]),
]
hf_image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
for f in range(files):
    images, captions, labels = [], [], []
    for i in range(per):
        n = f * per + i
        img = Image.new("RGB", (24 + n % 17, 16 + n % 13), ((n * 37) % 256, (n * 91) % 256, (n * 53) % 256))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=80)
        images.append(buf.getvalue())
        captions.append(f"caption {n}")
        labels.append(n % 10)
    if f % 2 == 0:
        image = pa.array([{"bytes": b, "path": f"{n}.jpg"} for n, b in enumerate(images)], type=hf_image)
    else:
        image = pa.array(images, type=pa.binary())
    table = pa.table({"image": image, "caption": captions, "label": labels})
    pq.write_table(table, f"{out}/{f:05d}.parquet", row_group_size=20, data_page_size=1024,
                   write_batch_size=2, **settings[f % len(settings)])
"#;

/// The index's table of file `n` (one JSON line of `parquet.jsonl` per file, in key order).
fn file_table(server: &S3Server, n: usize) -> FileTable {
    let tables = std::fs::read_to_string(
        server
            .root()
            .join(INDEX_BUCKET)
            .join("pq")
            .join("parquet.jsonl"),
    )
    .unwrap();
    serde_json::from_str(tables.lines().nth(n).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_once_across_four_ranks_with_captions_labels_and_a_corrupt_page() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    let (files, per) = (4, 60);
    write_with_python(&server, WRITE_FILES, "pq", files, per);

    let summary = index_process(
        &server,
        &[
            "--parquet",
            &format!("s3://{BUCKET}/pq/"),
            "--columns",
            "caption,label",
            "--out",
            &format!("s3://{INDEX_BUCKET}/pq/"),
        ],
    );
    eprintln!("index: {summary}");
    assert_eq!(summary["shards"], files);
    assert_eq!(summary["samples"], files * per);
    assert_eq!(summary["problems"], 0);

    // The writers' settings show in the index. The first file's images are all in its
    // chunks' dictionary pages (under pyarrow's 1 MiB dictionary limit), its data pages only
    // indices into them; the second file's pages are plain, a few rows each.
    let first = file_table(&server, 0);
    assert!(first.pages.iter().all(|p| p.dictionary));
    assert!(first.chunks.iter().all(|c| c.dictionary.is_some()));
    assert_eq!(first.max_def_level, 2, "image.bytes in an optional struct");
    let second = file_table(&server, 1);
    assert!(
        second.pages.len() >= per / 4,
        "{} pages",
        second.pages.len()
    );
    assert!(second.pages.iter().all(|p| !p.dictionary));
    assert_eq!(second.chunks[0].codec, "zstd");
    assert_eq!(second.max_def_level, 1, "an optional binary column");

    // After indexing, one page of the zstd file is overwritten: its rows are skipped as
    // corrupt, each with its row number; every other row of the file still arrives.
    let page = &second.pages[3];
    let first_row: u32 = second.pages[..3].iter().map(|p| p.rows).sum();
    let broken: HashSet<u64> = (first_row..first_row + page.rows).map(u64::from).collect();
    let path = server.root().join(BUCKET).join("pq/00001.parquet");
    let mut bytes = std::fs::read(&path).unwrap();
    let [a, b] = page.range.map(|x| x as usize);
    bytes[a + (b - a) / 2..b].fill(0x5a);
    std::fs::write(&path, &bytes).unwrap();

    let (source, _) = source(&server).await;
    let location = ManifestLocation::parse(&format!("s3://{INDEX_BUCKET}/pq/"));
    let table = ShardTable::load(&source, location).await.unwrap();
    assert_eq!(table.counts, vec![per as u32; files]);

    let mut worker = worker(Some(&server), 2).await;
    let mut delivered = Vec::new();
    for rank in 0..4 {
        for batch in shard_plan(rank, 4, 16).shard_plan_from(&table.counts, 50, Cursor::default()) {
            delivered
                .extend(decode_shard_samples(&mut worker, &table, &source, &batch.samples).await);
        }
    }
    let n = files * per;
    assert_eq!(delivered.len(), n, "240 rows divide by 4 ranks: no padding");
    let mut seen = HashSet::new();
    let mut skipped = HashMap::new();
    for d in &delivered {
        let file: usize = d.shard_key[3..8].parse().unwrap();
        let row = d.metadata["__row__"]
            .as_u64()
            .expect("every sample names its row");
        assert!(seen.insert((file, row)), "row {row} of file {file} twice");
        if !d.skip.is_empty() {
            skipped.insert((file, row), d.skip.clone());
            continue;
        }
        let number = file * per + row as usize;
        assert_eq!(d.metadata["caption"], format!("caption {number}"));
        assert_eq!(d.metadata["label"], number % 10);
        assert_eq!(
            d.orig_width,
            24 + (number % 17) as u32,
            "the row's own image"
        );
        assert_eq!(d.width, 16);
    }
    let expected: HashMap<(usize, u64), String> = broken
        .iter()
        .map(|&r| ((1, r), "corrupt".to_string()))
        .collect();
    assert_eq!(skipped, expected, "exactly the overwritten page's rows");
    assert_eq!(seen.len(), n, "every row once: delivered or skipped");
    let gets = get_requests(&worker);
    eprintln!(
        "{n} rows: {gets} range GETs ({:.2} per row), {} skipped",
        gets / n as f64,
        skipped.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_file_and_a_missing_column_are_reported_at_index_time() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    write_with_python(&server, WRITE_FILES, "pq", 2, 20);
    let path = server.root().join(BUCKET).join("pq/00001.parquet");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();

    // A file cut short has no footer: left out and reported; the other file is indexed.
    let summary = index_process(
        &server,
        &[
            "--parquet",
            &format!("s3://{BUCKET}/pq/{{00000..00001}}.parquet"),
            "--out",
            &format!("s3://{INDEX_BUCKET}/pq/"),
        ],
    );
    assert_eq!(summary["samples"], 20);
    assert_eq!(summary["problems"], 1);
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(server.root().join(INDEX_BUCKET).join("pq/index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["kind"], "parquet");
    let problem = &index["problems"][0];
    assert_eq!(problem["key"], "pq/00001.parquet");
    assert!(
        problem["reason"].as_str().unwrap().contains("PAR1"),
        "{problem}"
    );

    // A column the files do not have fails the build, naming the columns they do have.
    let file = format!("s3://{BUCKET}/pq/00000.parquet");
    let out = loader_command(&server, &["index", "--parquet", &file])
        .args(["--columns", "caption,score", "--out", "/dev/null/unused"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"score\"") && err.contains("caption, label"),
        "{err}"
    );
}

/// `profile --index` over Parquet: the sample is drawn and fetched as a worker's batches are,
/// and the GET rows show a page's cost: each GET reads the row's whole page (about two images
/// here), so more bytes than the image per image.
#[test]
fn profile_over_the_index_reports_what_a_page_costs() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    server.create_bucket(INDEX_BUCKET).unwrap();
    write_with_python(&server, WRITE_FILES, "pq", 2, 60);
    let out = format!("s3://{INDEX_BUCKET}/pq/");
    index_process(
        &server,
        &["--parquet", &format!("s3://{BUCKET}/pq/"), "--out", &out],
    );
    let profile = [
        "profile", "--bucket", BUCKET, "--index", &out, "--sample", "64",
    ];
    let run = loader_command(&server, &profile)
        .args([
            "--resize", "crop", "--width", "16", "--height", "16", "--json",
        ])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "profile failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    eprintln!("{report}");
    let num = |k: &str| {
        report[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k}: {report}"))
    };
    assert_eq!(num("listed_objects"), 120.0);
    assert_eq!(num("sampled"), 64.0);
    assert_eq!(num("decoded"), 64.0, "{report}");
    let requests = num("get_requests_per_image");
    assert!(requests > 0.0 && requests <= 2.0, "{report}");
    assert!(
        num("get_bytes_per_image") > num("encoded_bytes_per_image"),
        "a page holds more than the row: {report}"
    );
    assert!(num("get_mb_per_s_per_request") > 0.0);
}
