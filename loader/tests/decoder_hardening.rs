//! The real `stoker-loader decode`, started as the operator starts it (`--bucket`, `--prefix`):
//! it reads only its pipeline's objects, and a thousand oversized or malformed requests neither
//! stop it nor grow its memory.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use stoker_loader::proto;
use stoker_loader::proto::decode_service_client::DecodeServiceClient;
use stoker_loader::worker::DecodeClient;
use stoker_testenv::s3::S3Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// The decoder's resident memory must stay below this after the abuse: the process (24 MiB
/// measured after the run) plus its 8 requests in flight of at most 4 MiB, with room. Before
/// the request limit, one request could make it buffer 256 MiB.
const RSS_BOUND_MIB: u64 = 128;

/// A decoder process and what these tests read of it.
struct Decoder(DecoderProcess);

impl Decoder {
    fn rss_mib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.0.child.id()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            / 1024
    }

    async fn client(&self) -> DecodeClient {
        DecodeClient::connect(format!("http://{}", self.0.grpc))
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        stoker_testenv::http::get(self.0.http, "/metrics")
            .await
            .unwrap()
            .1
    }
}

/// Two threads, 4 batches admitted, 8 requests read at once.
fn start_decoder(server: &S3Server) -> Decoder {
    Decoder(spawn_decoder(
        server,
        &[
            "--bucket",
            BUCKET,
            "--prefix",
            "images/",
            "--threads",
            "2",
            "--queue-depth",
            "4",
        ],
    ))
}

fn objects() -> (tempfile::TempDir, S3Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path()).unwrap();
    let image = jpeg(320, 240);
    server.put_object(BUCKET, "images/a.jpg", &image).unwrap();
    server.put_object(BUCKET, "labels/a.jpg", &image).unwrap();
    server.put_object("other", "images/a.jpg", &image).unwrap();
    (dir, server)
}

async fn decodes(client: &mut DecodeClient) {
    let reply = client
        .decode_batch(request(&["images/a.jpg"], crop(64, 64)))
        .await
        .expect("an in-prefix batch decodes");
    assert_eq!(reply.samples[0].skip_reason, "");
    assert_eq!(reply.pixels.len(), 64 * 64 * 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_reads_only_its_pipelines_bucket_and_prefix() {
    let (_dir, server) = objects();
    let decoder = start_decoder(&server);
    let mut client = decoder.client().await;
    decodes(&mut client).await;

    let mut other_bucket = request(&["images/a.jpg"], crop(64, 64));
    other_bucket.bucket = "other".into();
    for (req, why) in [
        (other_bucket, "another bucket"),
        (
            request(&["labels/a.jpg"], crop(64, 64)),
            "a key outside the prefix",
        ),
        (
            request(&["images/a.jpg", "images/../labels/a.jpg"], crop(64, 64)),
            "a key leaving the prefix through ..",
        ),
    ] {
        let status = client.decode_batch(req).await.expect_err(why);
        assert_eq!(status.code(), Code::PermissionDenied, "{why}: {status:?}");
        assert!(status.message().contains("s3://data/images/"), "{status:?}");
    }
    let gets_before = server.requests_seen();
    decodes(&mut client).await;
    assert_eq!(
        server.requests_seen(),
        gets_before + 1,
        "refused batches never reached S3"
    );
    let text = decoder.metrics().await;
    let rejected = |reason: &str| {
        metric(
            &text,
            &format!("stoker_loader_rejected_batches_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(rejected("bucket_outside_pipeline"), 1.0);
    assert_eq!(rejected("key_outside_prefix"), 2.0);
}

/// Random bytes where an HTTP/2 preface belongs: the connection is dropped.
async fn garbage(addr: SocketAddr, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let bytes: Vec<u8> = (0..rng.usize(1..64 * 1024)).map(|_| rng.u8(..)).collect();
    let _ = conn.write_all(&bytes).await;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while matches!(conn.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// A request over the decoder's size limit (keys and metadata of 5 MiB), from a client that
/// does not hold itself to the limit.
fn oversized() -> proto::DecodeBatchRequest {
    let mut req = request(&["images/a.jpg"], crop(64, 64));
    req.samples[0].metadata = "x".repeat(5 << 20);
    req
}

/// 1,024 outputs of 448² x 3: 616 MB of pixels, more than one reply may carry.
fn reply_too_large() -> proto::DecodeBatchRequest {
    request(&["images/a.jpg"; 1024], crop(448, 448))
}

fn malformed(i: usize) -> proto::DecodeBatchRequest {
    let mut req = request(&["images/a.jpg"], crop(64, 64));
    match i % 3 {
        0 => req.transform = None,
        1 => {
            req.transform = Some(proto::Transform {
                resize: "sideways".into(),
                ..crop(64, 64)
            })
        }
        _ => req.samples = vec![req.samples[0].clone(); 5000],
    }
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_survives_a_thousand_bad_requests_within_its_memory() {
    let (_dir, server) = objects();
    let decoder = start_decoder(&server);
    let mut client = decoder.client().await;
    decodes(&mut client).await;

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", decoder.0.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let unlimited = DecodeServiceClient::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    let mut tasks = tokio::task::JoinSet::new();
    let mut codes = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..1000usize {
        let grpc = decoder.0.grpc;
        let mut c = unlimited.clone();
        tasks.spawn(async move {
            let req = match i % 4 {
                0 => {
                    garbage(grpc, i as u64).await;
                    return "garbage".to_string();
                }
                1 => oversized(),
                2 => reply_too_large(),
                _ => malformed(i),
            };
            match c.decode_batch(req).await {
                Ok(_) => "ok".to_string(),
                Err(status) => format!("{:?}", status.code()),
            }
        });
        // Sixteen at a time: enough to contend for the decoder's eight request slots.
        if tasks.len() >= 16 {
            let code = tasks.join_next().await.unwrap().unwrap();
            *codes.entry(code).or_default() += 1;
        }
    }
    while let Some(code) = tasks.join_next().await {
        *codes.entry(code.unwrap()).or_default() += 1;
    }
    assert_eq!(codes.get("ok"), None, "{codes:?}");
    assert_eq!(codes.get("garbage"), Some(&250), "{codes:?}");
    // Oversized requests: OUT_OF_RANGE from their length prefix; malformed ones:
    // INVALID_ARGUMENT; replies too large and busy request slots: RESOURCE_EXHAUSTED. Each
    // kind reached its own check (some also found every slot busy).
    for code in ["OutOfRange", "InvalidArgument", "ResourceExhausted"] {
        assert!(codes.get(code).is_some_and(|n| *n > 100), "{codes:?}");
    }
    for code in codes.keys().filter(|c| *c != "garbage") {
        assert!(
            ["OutOfRange", "ResourceExhausted", "InvalidArgument"].contains(&code.as_str()),
            "{codes:?}"
        );
    }

    // The reply-size refusal names the limit.
    let status = unlimited
        .clone()
        .decode_batch(reply_too_large())
        .await
        .expect_err("too large a reply");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("MAX_BATCH_PIXEL_BYTES"),
        "{status:?}"
    );
    // The decoder's own client refuses an oversized request before sending it.
    let local = client
        .decode_batch(oversized())
        .await
        .expect_err("too large");
    assert_eq!(local.code(), Code::OutOfRange, "{local:?}");
    assert!(local.message().contains("MAX_REQUEST_BYTES"), "{local:?}");

    decodes(&mut client).await;
    let rss = decoder.rss_mib();
    assert!(rss < RSS_BOUND_MIB, "decoder RSS {rss} MiB");
    let text = decoder.metrics().await;
    assert!(
        metric(
            &text,
            "stoker_loader_rejected_batches_total{reason=\"reply_too_large\"}"
        ) >= 1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "stoker_loader_samples_out_total"),
        2.0,
        "no bad request decoded anything"
    );
}
