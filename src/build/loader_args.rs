//! The command lines of `stoker-loader`'s decode workers and sidecars, built as the typed
//! structs the loader parses ([`stoker_contract`]), so that `kubectl describe pod` shows every
//! setting and the two ends cannot drift.

use std::net::{Ipv4Addr, SocketAddr};

use kube::ResourceExt;
use stoker_contract::{
    DECODER_GRPC_PORT, DecodeArgs, IndexArgs, LoaderCommand, RenderError, ResizeMode, S3Args,
    SHM_DIR, SIDECAR_HEALTH_PORT, SidecarArgs, TransformArgs, decoder_discovery_selector,
    slot_bytes,
};

use crate::api::DataPipeline;

/// S3 access shared by both roles; credentials come from the Secret through the environment.
fn s3_args(dp: &DataPipeline, defaults: S3Args) -> S3Args {
    let s3 = &dp.spec.source.s3;
    S3Args {
        endpoint: s3.endpoint.clone(),
        region: s3.region.clone(),
        force_path_style: s3.force_path_style,
        ..defaults
    }
}

/// A CRD integer (the API server bounds it) as the loader's type, else the loader's default.
fn or_default<T: TryFrom<i64>>(value: Option<i64>, default: T) -> T {
    value.and_then(|v| T::try_from(v).ok()).unwrap_or(default)
}

fn transform_args(dp: &DataPipeline, defaults: TransformArgs) -> TransformArgs {
    let resize = &dp.spec.transform.resize;
    TransformArgs {
        resize: resize.mode,
        width: or_default(resize.width, defaults.width),
        height: or_default(resize.height, defaults.height),
        factor: or_default(resize.patch_factor, defaults.factor),
        min_pixels: or_default(resize.min_pixels, defaults.min_pixels),
        max_pixels: or_default(resize.max_pixels, defaults.max_pixels),
        ..defaults
    }
}

/// `stoker-loader decode` for `dp`'s decoders: they read only the pipeline's bucket, and keys
/// under its prefix unless a manifest lists the keys (which may lie anywhere in the bucket;
/// the sidecar GETs them from the pipeline's bucket, not the manifest's). Threads are the
/// pod's CPUs, so that the memory bound the pod's default limit comes from holds.
pub fn decode(dp: &DataPipeline) -> Result<DecodeArgs, clap::Error> {
    let defaults = DecodeArgs::parse_flags(std::iter::empty::<String>())?;
    let s3 = &dp.spec.source.s3;
    let prefix = match (&dp.spec.source.manifest, &s3.prefix) {
        (None, Some(prefix)) if !prefix.is_empty() => Some(prefix.clone()),
        _ => None,
    };
    Ok(DecodeArgs {
        bucket: Some(s3.bucket.clone()),
        prefix,
        grpc_addr: SocketAddr::from((Ipv4Addr::UNSPECIFIED, DECODER_GRPC_PORT)),
        threads: super::decoder_pod::decoder_cpus(dp),
        s3: s3_args(dp, defaults.s3.clone()),
        tls: super::decoder_pod::tls_args(dp),
        ..defaults
    })
}

/// `stoker-loader sidecar` for `dp`'s trainers: the epoch plan, the transform it asks
/// decoders for, where to find them (through the Kubernetes API), and the hand-off.
pub fn sidecar(dp: &DataPipeline) -> Result<SidecarArgs, clap::Error> {
    let spec = &dp.spec;
    let defaults = SidecarArgs::of_bucket(&spec.source.s3.bucket)?;
    let transform = transform_args(dp, defaults.transform.clone());
    let batch_size = or_default(Some(spec.batch.size), defaults.batch_size);
    // qwenSmart sizes vary: a slot holds the largest the pipeline allows, as the CRD's
    // shared-memory rule counts it.
    let slot_bytes = (transform.resize == ResizeMode::QwenSmart)
        .then(|| slot_bytes(batch_size as u64, transform.max_pixels))
        .and_then(|b| usize::try_from(b).ok());
    Ok(SidecarArgs {
        prefix: spec.source.s3.prefix.clone().unwrap_or_default(),
        manifest: spec.source.manifest.clone(),
        index: spec.source.indexed().map(|d| d.index.to_string()),
        shuffle_window: spec
            .source
            .indexed()
            .and_then(|d| d.shuffle_window)
            .map_or(defaults.shuffle_window, |w| w as usize),
        batch_size,
        seed: or_default(spec.batch.shuffle_seed, defaults.seed),
        no_shuffle: spec.batch.shuffle_seed.is_none(),
        drop_last: spec.batch.drop_last,
        prefetch_batches: or_default(
            Some(spec.trainer.prefetch_batches),
            defaults.prefetch_batches,
        ),
        // No --socket: the sidecar names one per local rank in the shm dir, which the trainers'
        // clients find by their LOCAL_RANK.
        shm_dir: SHM_DIR.into(),
        http_addr: SocketAddr::from((Ipv4Addr::UNSPECIFIED, SIDECAR_HEALTH_PORT)),
        workers_selector: Some(decoder_discovery_selector(&dp.name_any())),
        workers_namespace: dp.namespace().unwrap_or_default(),
        pipeline: Some(dp.name_any()),
        pipeline_uid: dp.uid(),
        workers_port: DECODER_GRPC_PORT,
        gpu_placement: spec.trainer.gpu_placement,
        slot_bytes,
        transform,
        s3: s3_args(dp, defaults.s3.clone()),
        tls: super::decoder_pod::tls_args(dp),
        ..defaults
    })
}

/// The decoder container's args.
pub fn decoder_args(dp: &DataPipeline) -> Result<Vec<String>, RenderError> {
    decode(dp).map_err(RenderError::Parse)?.command_line()
}

/// The sidecar container's args.
pub fn sidecar_args(dp: &DataPipeline) -> Result<Vec<String>, RenderError> {
    sidecar(dp).map_err(RenderError::Parse)?.command_line()
}

/// Where a container's termination message goes (the pod's `terminationMessagePath` default).
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// `stoker-loader index` for a `webDataset` or `parquet` pipeline's index Job (`None` for
/// other sources), with the pipeline's S3 settings.
pub fn index(dp: &DataPipeline) -> Result<Option<IndexArgs>, clap::Error> {
    let Some(dataset) = dp.spec.source.indexed() else {
        return Ok(None);
    };
    let defaults = IndexArgs::of(dataset.kind, dataset.files, dataset.index)?;
    Ok(Some(IndexArgs {
        image_column: dataset
            .image_column
            .map_or(defaults.image_column.clone(), str::to_string),
        columns: dataset.columns.to_vec(),
        summary_file: Some(TERMINATION_LOG.into()),
        s3: s3_args(dp, defaults.s3.clone()),
        ..defaults
    }))
}

/// The index Job's container args, `None` for sources without an index.
pub fn index_args(dp: &DataPipeline) -> Result<Option<Vec<String>>, RenderError> {
    index(dp)
        .map_err(RenderError::Parse)?
        .map(|args| args.command_line())
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_contract::GpuPlacement;

    fn dp(fixture: &str) -> DataPipeline {
        serde_yaml::from_str(fixture).expect("fixture")
    }

    /// What the operator writes into a pod parses in the loader to what the operator meant.
    #[test]
    fn every_argument_parses_back_in_the_loader() {
        for fixture in [
            include_str!("../../tests/fixtures/datapipeline-crop.yaml"),
            include_str!("../../examples/objects.yaml"),
            include_str!("../../examples/manifest.yaml"),
            include_str!("../../examples/webdataset.yaml"),
            include_str!("../../examples/parquet.yaml"),
            include_str!("../../tests/fixtures/datapipeline-qwen.yaml"),
        ] {
            let dp = dp(fixture);
            let sidecar = sidecar(&dp).expect("builds");
            let line = sidecar.command_line().expect("renders");
            assert_eq!(
                SidecarArgs::parse_flags(&line[1..]).expect("parses"),
                sidecar
            );
            let decode = decode(&dp).expect("builds");
            let line = decode.command_line().expect("renders");
            assert_eq!(DecodeArgs::parse_flags(&line[1..]).expect("parses"), decode);
            if let Some(index) = index(&dp).expect("builds") {
                let line = index.command_line().expect("renders");
                assert_eq!(IndexArgs::parse_flags(&line[1..]).expect("parses"), index);
            }
        }
    }

    #[test]
    fn a_parquet_index_job_reads_the_named_columns() {
        let dp = dp(include_str!("../../examples/parquet.yaml"));
        let line = index_args(&dp).expect("renders").expect("an index");
        // What the Job's loader parses, not how the flags are spelled (contract's own).
        let job = IndexArgs::parse_flags(&line[1..]).expect("parses");
        assert_eq!(
            job.parquet.as_deref(),
            Some("s3://captions/train/{00000..00099}.parquet")
        );
        assert_eq!(job.columns, ["caption", "label"]);
        assert_eq!(job.shards, None);
        let args = sidecar(&dp).expect("builds");
        assert_eq!(args.index.as_deref(), Some("s3://captions-index/v1/"));
    }

    #[test]
    fn a_web_dataset_sidecar_plans_over_the_index_and_decoders_keep_the_prefix() {
        let dp = dp(include_str!("../../examples/webdataset.yaml"));
        let args = sidecar(&dp).expect("builds");
        assert_eq!(args.index.as_deref(), Some("s3://laion-index/v1/"));
        assert_eq!(args.manifest, None);
        assert_eq!(args.shuffle_window, 10_000);
        let line = sidecar_args(&dp).expect("renders");
        let parsed = SidecarArgs::parse_flags(&line[1..]).expect("parses");
        assert_eq!(parsed.index.as_deref(), Some("s3://laion-index/v1/"));
        let decode = decode(&dp).expect("builds");
        assert_eq!(decode.bucket.as_deref(), Some("laion"));
        assert_eq!(decode.prefix.as_deref(), Some("shards/"));

        let mut other = dp.clone();
        other
            .spec
            .source
            .web_dataset
            .as_mut()
            .expect("wds")
            .shuffle_window = Some(500);
        assert_eq!(sidecar(&other).expect("builds").shuffle_window, 500);
        let plain = self::dp(include_str!("../../examples/objects.yaml"));
        assert_eq!(sidecar(&plain).expect("builds").index, None);
    }

    #[test]
    fn decoders_serve_only_the_pipelines_source() {
        // The crop fixture lists its keys in a manifest: the whole bucket, no prefix.
        let manifest = dp(include_str!("../../tests/fixtures/datapipeline-crop.yaml"));
        let args = decode(&manifest).expect("builds");
        assert_eq!(args.bucket.as_deref(), Some("laion-subset"));
        assert_eq!(args.prefix, None);
        let mut listed = manifest.clone();
        listed.spec.source.manifest = None;
        let line = decoder_args(&listed).expect("renders");
        let parsed = DecodeArgs::parse_flags(&line[1..]).expect("parses");
        assert_eq!(
            (parsed.bucket.as_deref(), parsed.prefix.as_deref()),
            (Some("laion-subset"), Some("images/"))
        );
        // The fixture requests 4 CPUs: four decode threads.
        assert_eq!(decode(&listed).expect("builds").threads, 4);
    }

    #[test]
    fn the_sidecar_asks_for_what_the_spec_says() {
        let dp = dp(include_str!("../../tests/fixtures/datapipeline-qwen.yaml"));
        let args = sidecar(&dp).expect("builds");
        let spec = &dp.spec;
        assert_eq!(args.bucket, spec.source.s3.bucket);
        assert_eq!(Ok(args.batch_size), usize::try_from(spec.batch.size));
        assert_eq!(args.transform.resize, ResizeMode::QwenSmart);
        assert_eq!(args.transform.max_pixels, 1_003_520);
        assert_eq!(args.transform.factor, 28);
        // Slots hold maxPixels per sample: no good image is skipped as too large.
        assert_eq!(args.slot_bytes, Some(16 * 1_003_520 * 3));
        let crop = self::dp(include_str!("../../tests/fixtures/datapipeline-crop.yaml"));
        assert_eq!(sidecar(&crop).expect("builds").slot_bytes, None);
        assert_eq!(args.gpu_placement, spec.trainer.gpu_placement);
        assert_eq!(
            args.socket, None,
            "one socket per local rank, named by the sidecar"
        );
        assert_eq!(args.shm_dir.to_str(), Some(SHM_DIR));
        let mut host = dp.clone();
        host.spec.trainer.gpu_placement = GpuPlacement::Host;
        let line = sidecar_args(&host).expect("renders");
        let parsed = SidecarArgs::parse_flags(&line[1..]).expect("parses");
        assert_eq!(parsed.gpu_placement, GpuPlacement::Host);
    }
}
