//! `stoker-loader profile`, the real binary against the real S3 server: every row of its table
//! and every field of its `--json` report is there, numeric and plausible.

mod common;

use common::*;
use serde_json::Value;
use stoker_testenv::s3::S3Server;

/// Sizes of an ImageNet-like sample, landscape and portrait, some large enough to scale.
const SIZES: [(u32, u32); 12] = [
    (500, 375),
    (375, 500),
    (500, 333),
    (640, 480),
    (1024, 768),
    (768, 1024),
    (1600, 1200),
    (333, 500),
    (400, 300),
    (500, 500),
    (1023, 767),
    (899, 601),
];
const SAMPLE: usize = 10;
const TARGET_RATE: f64 = 2400.0;

fn dataset() -> (tempfile::TempDir, S3Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    for (i, (w, h)) in SIZES.into_iter().enumerate() {
        server
            .put_object(BUCKET, &format!("imgs/{i:03}.jpg"), &jpeg(w, h))
            .unwrap();
    }
    (dir, server)
}

fn profile(server: &S3Server, extra: &[&str]) -> String {
    let out = loader_command(
        server,
        &["profile", "--bucket", BUCKET, "--prefix", "imgs/"],
    )
    .args(["--sample", &SAMPLE.to_string()])
    .args(["--target-rate", &TARGET_RATE.to_string()])
    .args(["--resize", "crop", "--width", "448", "--height", "448"])
    .args(extra)
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "profile failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The leading number of a table cell ("1.23 ms / 4.56 ms" -> 1.23), and the rest.
fn number(cell: &str) -> (f64, &str) {
    let cell = cell.trim_start();
    let end = cell
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
        .unwrap_or(cell.len());
    let v = cell[..end]
        .parse()
        .unwrap_or_else(|_| panic!("no number at the start of {cell:?}"));
    (v, &cell[end..])
}

#[test]
fn profile_table_has_every_stage() {
    let (_dir, server) = dataset();
    let table = profile(&server, &[]);
    let rows: Vec<(&str, &str)> = table
        .lines()
        .map(|l| {
            let (k, v) = l.split_once("  ").unwrap();
            (k.trim(), v.trim())
        })
        .collect();
    let labels: Vec<&str> = rows.iter().map(|(k, _)| *k).collect();
    let cores_row = format!("cores for {TARGET_RATE:.0} images/s");
    assert_eq!(
        labels,
        [
            "transform",
            "objects listed",
            "sampled / decoded",
            "GET latency p50 / p90",
            "GET throughput",
            "GET requests per image",
            "GET size",
            "GET bytes per image",
            "throughput per GET",
            "CPU per image: get",
            "CPU per image: decode",
            "CPU per image: resize",
            "CPU per image: pack",
            "CPU per image: decode path",
            "CPU per image: reply",
            "CPU per image: all",
            "CPU outside decode path",
            "images/s per core",
            "bytes per image enc → dec",
            cores_row.as_str(),
            "decoded egress at target",
        ],
        "{table}"
    );
    let cell = |label: &str| rows.iter().find(|(k, _)| *k == label).unwrap().1;
    assert_eq!(cell("transform"), "crop");

    let (listed, rest) = number(cell("objects listed"));
    assert_eq!(listed, SIZES.len() as f64);
    let (list_s, unit) = number(rest.trim_start_matches(" in"));
    assert!(list_s >= 0.0 && unit == " s", "{table}");

    assert_eq!(cell("sampled / decoded"), format!("{SAMPLE} / {SAMPLE}"));

    let (p50, rest) = number(cell("GET latency p50 / p90"));
    let (p90, unit) = number(rest.trim_start_matches(" ms /"));
    assert!(p50 > 0.0 && p90 >= p50 && unit == " ms", "{table}");

    let (mbps, rest) = number(cell("GET throughput"));
    assert!(mbps > 0.0 && rest == " MB/s at 16 in flight", "{table}");

    // One object per image: one GET each, of the image's own size.
    assert_eq!(cell("GET requests per image"), "1.000", "{table}");
    let (size, unit) = number(cell("GET size"));
    assert!(size > 0.0 && unit == " KB", "{table}");
    let (per_image, rest) = number(cell("GET bytes per image"));
    assert!(
        (per_image - size).abs() < 0.11 && rest == " KB (1.00x the image)",
        "{table}"
    );
    let (one, unit) = number(cell("throughput per GET"));
    assert!(one > 0.0 && unit == " MB/s", "{table}");

    let mut stages = 0.0;
    let mut outside = 0.0;
    for stage in ["get", "decode", "resize", "pack", "reply"] {
        let (ms, unit) = number(cell(&format!("CPU per image: {stage}")));
        // Pack (headers, the batch buffer) can round to 0.000 on a small sample.
        let floor = if stage == "pack" { 0.0 } else { 1e-9 };
        assert!(
            ms >= floor && ms < 1000.0 && unit == " ms",
            "{stage}: {table}"
        );
        if stage == "get" || stage == "reply" {
            outside += ms;
        } else {
            stages += ms;
        }
    }
    let (total, unit) = number(cell("CPU per image: decode path"));
    assert!(unit == " ms", "{table}");
    // Cells are rounded to 3 decimals each.
    assert!(
        (stages - total).abs() <= 0.002,
        "{stages} vs {total}: {table}"
    );

    // All of a worker's CPU per image: get + decode path + reply.
    let (all, unit) = number(cell("CPU per image: all"));
    assert!(unit == " ms", "{table}");
    assert!(
        (outside + total - all).abs() <= 0.003,
        "{outside} + {total} vs {all}: {table}"
    );
    let (share, unit) = number(cell("CPU outside decode path"));
    assert!(unit == " %", "{table}");
    assert!(
        (share - outside / all * 100.0).abs() <= 0.5,
        "{share} vs {outside} / {all}: {table}"
    );

    let (per_core, rest) = number(cell("images/s per core"));
    assert!(rest.is_empty() && (per_core - 1000.0 / total).abs() <= per_core * 0.01 + 1.0);

    let (enc, rest) = number(cell("bytes per image enc → dec"));
    let (dec, rest) = number(rest.trim_start_matches(" KB →"));
    assert!(enc > 0.0 && rest.starts_with(" KB ("), "{table}");
    // 448 x 448 x 3 bytes.
    assert_eq!(dec, 602.0, "{table}");

    let (cores, rest) = number(cell(&cores_row));
    assert!(rest.is_empty() && (cores - TARGET_RATE / per_core).abs() <= 0.1);

    let (gbit, unit) = number(cell("decoded egress at target"));
    assert_eq!(unit, " Gbit/s");
    assert!(
        (gbit - TARGET_RATE * 602_112.0 * 8.0 / 1e9).abs() < 0.01,
        "{table}"
    );
}

#[test]
fn profile_json_has_every_field() {
    let (_dir, server) = dataset();
    let report: Value = serde_json::from_str(&profile(&server, &["--json"])).unwrap();
    let obj = report.as_object().unwrap();
    let num = |k: &str| -> f64 {
        obj.get(k)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{k} missing or not a number: {report}"))
    };
    let mut fields: Vec<&str> = obj.keys().map(String::as_str).collect();
    fields.sort();
    let mut expected = vec![
        "transform",
        "listed_objects",
        "list_seconds",
        "sampled",
        "decoded",
        "skips",
        "get_p50_ms",
        "get_p90_ms",
        "get_mb_per_s",
        "get_concurrency",
        "get_requests_per_image",
        "get_bytes_per_request",
        "get_bytes_per_image",
        "get_mb_per_s_per_request",
        "get_cpu_ms_per_image",
        "decode_ms_per_image",
        "resize_ms_per_image",
        "pack_ms_per_image",
        "cpu_ms_per_image",
        "reply_cpu_ms_per_image",
        "all_cpu_ms_per_image",
        "outside_decode_percent",
        "images_per_second_per_core",
        "encoded_bytes_per_image",
        "decoded_bytes_per_image",
        "target_images_per_second",
        "cores_needed",
        "egress_gbit_per_s_at_target",
    ];
    expected.sort();
    assert_eq!(fields, expected);

    assert_eq!(obj["transform"], "crop");
    assert_eq!(obj["skips"], serde_json::json!({}));
    assert_eq!(num("listed_objects"), SIZES.len() as f64);
    assert_eq!(num("sampled"), SAMPLE as f64);
    assert_eq!(num("decoded"), SAMPLE as f64);
    assert_eq!(num("get_concurrency"), 16.0);
    assert!(num("list_seconds") >= 0.0);
    assert!(num("get_p50_ms") > 0.0 && num("get_p90_ms") >= num("get_p50_ms"));
    assert!(num("get_mb_per_s") > 0.0);
    assert_eq!(num("get_requests_per_image"), 1.0);
    assert_eq!(num("get_bytes_per_image"), num("encoded_bytes_per_image"));
    assert_eq!(num("get_bytes_per_request"), num("encoded_bytes_per_image"));
    assert!(num("get_mb_per_s_per_request") > 0.0);
    let (get, decode, resize, pack, total, reply) = (
        num("get_cpu_ms_per_image"),
        num("decode_ms_per_image"),
        num("resize_ms_per_image"),
        num("pack_ms_per_image"),
        num("cpu_ms_per_image"),
        num("reply_cpu_ms_per_image"),
    );
    for (k, v) in [
        ("get", get),
        ("decode", decode),
        ("resize", resize),
        ("reply", reply),
    ] {
        assert!(v > 0.0 && v < 1000.0, "{k}: {v}");
    }
    assert!(pack >= 0.0);
    // The stages split the decode thread's CPU time: they add up to the total, no more.
    assert!(decode + resize + pack <= total * (1.0 + 1e-9), "{report}");
    assert!(decode + resize + pack >= total * 0.999, "{report}");
    // A worker's whole CPU per image, and the share of it outside decode + resize + pack.
    let all = num("all_cpu_ms_per_image");
    assert!(
        (all - (get + total + reply)).abs() <= all * 1e-9,
        "{report}"
    );
    let outside = num("outside_decode_percent");
    assert!(
        (outside - (get + reply) / all * 100.0).abs() <= 1e-6,
        "{report}"
    );
    assert!(outside > 0.0 && outside < 100.0, "{report}");
    let per_core = num("images_per_second_per_core");
    assert!(
        (per_core - 1000.0 / total).abs() <= per_core * 1e-6,
        "{report}"
    );
    // The encoded objects: average of the sampled ones, so within the dataset's range.
    let sizes: Vec<f64> = SIZES
        .iter()
        .map(|&(w, h)| jpeg(w, h).len() as f64)
        .collect();
    let enc = num("encoded_bytes_per_image");
    assert!(enc >= sizes.iter().cloned().fold(f64::MAX, f64::min));
    assert!(enc <= sizes.iter().cloned().fold(0.0, f64::max));
    assert_eq!(num("decoded_bytes_per_image"), 448.0 * 448.0 * 3.0);
    assert_eq!(num("target_images_per_second"), TARGET_RATE);
    assert!((num("cores_needed") - TARGET_RATE / per_core).abs() < 1e-9);
    let egress = TARGET_RATE * 448.0 * 448.0 * 3.0 * 8.0 / 1e9;
    assert!((num("egress_gbit_per_s_at_target") - egress).abs() < 1e-9);
}
