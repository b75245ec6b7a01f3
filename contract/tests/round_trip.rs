//! Every argument rendered for the loader parses back to the same values.

use std::path::PathBuf;

use stoker_contract::{
    DecodeArgs, GpuPlacement, IndexArgs, IndexFiles, LoaderCommand, ResizeMode, S3Args,
    SidecarArgs, TlsArgs, TransformArgs,
};

fn s3() -> S3Args {
    S3Args {
        endpoint: Some("http://minio.storage:9000".into()),
        region: Some("eu-west-1".into()),
        force_path_style: true,
        max_concurrent_gets: 17,
        max_attempts: 3,
        max_object_bytes: 5 << 20,
    }
}

fn tls() -> TlsArgs {
    TlsArgs {
        tls_dir: Some(PathBuf::from("/etc/stoker/tls")),
        tls_peer_name: Some("p-decoders.training.svc".into()),
    }
}

/// Every field away from its default, so that a field the renderer drops shows up.
fn sidecar() -> SidecarArgs {
    SidecarArgs {
        bucket: "laion".into(),
        prefix: "images/".into(),
        manifest: Some("s3://laion/train.jsonl".into()),
        index: None,
        shuffle_window: 500,
        batch_size: 7,
        seed: 9,
        no_shuffle: true,
        drop_last: true,
        rank: Some(3),
        node_rank: 1,
        world_size: 8,
        local_rank: 2,
        local_ranks: 4,
        start_epoch: 5,
        start_batch: 6,
        epochs: 11,
        prefetch_batches: 12,
        held_batches: 3,
        slot_bytes: Some(1 << 20),
        shm_dir: PathBuf::from("/dev/shm/x"),
        socket: Some(PathBuf::from("/dev/shm/x/s.sock")),
        http_addr: "127.0.0.1:9999".parse().unwrap(),
        workers: vec!["a:1".into(), "b:2".into()],
        workers_dns: Some("decoders.training".into()),
        workers_selector: Some("stoker.dev/pipeline=p".into()),
        workers_namespace: "training".into(),
        workers_port: 5000,
        discovery_interval_secs: 4,
        batch_timeout_secs: 2.5,
        source_retry_secs: 90,
        pipeline: Some("laion-vl".into()),
        pipeline_uid: Some("0f6c".into()),
        max_worker_failures: 5,
        set_aside_secs: 7,
        local_decoders: 2,
        local_share: 0.25,
        pod_name: Some("trainer-0".into()),
        no_local_fallback: true,
        gpu_placement: GpuPlacement::Host,
        max_source_pixels: 1000,
        transform: TransformArgs {
            resize: ResizeMode::QwenSmart,
            width: 224,
            height: 336,
            pad: 5,
            factor: 32,
            min_pixels: 100,
            max_pixels: 200_000,
        },
        s3: s3(),
        tls: tls(),
    }
}

fn parse_back<T: LoaderCommand>(args: &T) -> T {
    let line = args.command_line().expect("renders");
    assert_eq!(line[0], T::SUBCOMMAND);
    T::parse_flags(&line[1..]).unwrap_or_else(|e| panic!("{line:?} does not parse: {e}"))
}

#[test]
fn sidecar_arguments_parse_back_to_the_same_values() {
    assert_eq!(parse_back(&sidecar()), sidecar());
    // A WebDataset source: the index instead of the manifest (the two exclude each other).
    let sharded = SidecarArgs {
        manifest: None,
        index: Some("s3://laion-index/v1/".into()),
        ..sidecar()
    };
    assert_eq!(parse_back(&sharded), sharded);
    let both = [
        "--bucket",
        "b",
        "--manifest",
        "s3://b/m.jsonl",
        "--index",
        "s3://i/",
    ];
    assert!(SidecarArgs::parse_flags(both).is_err());
}

#[test]
fn index_arguments_parse_back_to_the_same_values() {
    let index = IndexArgs {
        shards: Some("s3://laion/shards/{00000..04095}.tar".into()),
        parquet: None,
        image_column: "image".into(),
        columns: Vec::new(),
        out: "s3://laion-index/v1/".into(),
        parallel: 3,
        summary_file: Some(PathBuf::from("/dev/termination-log")),
        s3: s3(),
    };
    assert_eq!(parse_back(&index), index);
    let parquet = IndexArgs {
        shards: None,
        parquet: Some("s3://captions/train/{00000..00099}.parquet".into()),
        image_column: "jpeg".into(),
        columns: vec!["caption".into(), "label".into()],
        ..index
    };
    assert_eq!(parse_back(&parquet), parquet);
    // One dataset per index: both kinds at once is refused.
    let both = [
        "--shards",
        "s3://a/{0..1}.tar",
        "--parquet",
        "s3://a/0.parquet",
        "--out",
        "s3://i/",
    ];
    assert!(IndexArgs::parse_flags(both).is_err());
}

#[test]
fn each_kind_of_index_files_names_its_own_field() {
    let shards = IndexArgs::of(IndexFiles::Shards, "s3://a/{0..1}.tar", "s3://i/").unwrap();
    assert_eq!(IndexFiles::Shards.flag(), "--shards");
    assert_eq!(
        (shards.shards.as_deref(), shards.parquet),
        (Some("s3://a/{0..1}.tar"), None)
    );
    let parquet = IndexArgs::of(IndexFiles::Parquet, "s3://a/0.parquet", "s3://i/").unwrap();
    assert_eq!(IndexFiles::Parquet.flag(), "--parquet");
    assert_eq!(
        (
            parquet.shards,
            parquet.parquet.as_deref(),
            parquet.out.as_str()
        ),
        (None, Some("s3://a/0.parquet"), "s3://i/")
    );
    assert_eq!(SidecarArgs::of_bucket("b").unwrap().bucket, "b");
}

#[test]
fn decode_arguments_parse_back_to_the_same_values() {
    let args = DecodeArgs {
        bucket: Some("laion".into()),
        prefix: Some("images/".into()),
        grpc_addr: "127.0.0.1:1".parse().unwrap(),
        http_addr: "127.0.0.1:2".parse().unwrap(),
        threads: 3,
        queue_depth: 4,
        max_source_pixels: 5,
        drain_timeout_secs: 6,
        s3: s3(),
        tls: tls(),
    };
    assert_eq!(parse_back(&args), args);
    let whole_bucket = DecodeArgs {
        prefix: None,
        ..args.clone()
    };
    assert_eq!(parse_back(&whole_bucket), whole_bucket);
}

#[test]
fn a_decoder_prefix_needs_its_bucket() {
    assert!(DecodeArgs::parse_flags(["--prefix", "images/"]).is_err());
    let unscoped = DecodeArgs::parse_flags(std::iter::empty::<String>()).expect("defaults");
    assert_eq!((unscoped.bucket, unscoped.prefix), (None, None));
}

/// The bound adds up the parts the decoder holds: 2 threads decoding 64 Mpx at 16 bytes, 6
/// admitted batches of 32 x (2 MiB encoded + 448² x 3), 12 requests of 4 MiB, 128 MiB.
#[test]
fn decoder_memory_bound_adds_up_its_parts() {
    let args = DecodeArgs::parse_flags(std::iter::empty::<String>()).expect("defaults");
    let batch = 32 * ((2 << 20) + 448 * 448 * 3);
    assert_eq!(
        args.memory_bound(2, 32, 448 * 448),
        2 * (64 << 20) * 16 + 6 * batch + 12 * (4 << 20) + (128 << 20)
    );
    let smaller = DecodeArgs {
        max_source_pixels: 16 << 20,
        queue_depth: 2,
        ..args.clone()
    };
    assert!(smaller.memory_bound(2, 32, 448 * 448) < args.memory_bound(2, 32, 448 * 448));
}

#[test]
fn defaults_that_the_environment_may_set_are_left_to_it() {
    let mut args = SidecarArgs::parse_flags(["--bucket", "b"]).expect("defaults");
    args.workers_namespace = "training".into();
    let line = args.command_line().expect("renders").join(" ");
    // RANK, WORLD_SIZE, STOKER_LOCAL_SHARE, ... decide in the pod.
    for absent in [
        "--rank",
        "--world-size",
        "--local-rank",
        "--local-share",
        "--prefix",
    ] {
        assert!(!line.contains(&format!("{absent} ")), "{absent} in {line}");
    }
    assert!(line.starts_with("sidecar --bucket b "), "{line}");
    assert!(line.contains("--workers-namespace training"), "{line}");
    assert!(line.contains("--resize crop"), "{line}");
    assert!(line.contains("--gpu-placement auto"), "{line}");
    // A value the environment could set is still sent when it is not the default.
    args.rank = Some(1);
    assert!(
        args.command_line()
            .expect("renders")
            .join(" ")
            .contains("--rank 1")
    );
}

#[test]
fn one_spelling_per_mode() {
    let mut args = sidecar();
    args.transform.resize = ResizeMode::QwenSmart;
    let line = args.command_line().expect("renders").join(" ");
    assert!(line.contains("--resize qwenSmart"), "{line}");
    assert_eq!(
        serde_json::to_value(ResizeMode::QwenSmart).unwrap(),
        "qwenSmart"
    );
    assert_eq!(serde_json::to_value(GpuPlacement::Host).unwrap(), "host");
    for mode in <ResizeMode as clap::ValueEnum>::value_variants() {
        let clap_name = clap::ValueEnum::to_possible_value(mode).expect("visible");
        assert_eq!(clap_name.get_name(), mode.as_str());
        assert_eq!(serde_json::to_value(mode).unwrap(), mode.as_str());
    }
}
