//! The command lines of `stoker-loader`'s decode workers and sidecars: the one contract between
//! the operator and the loader binary, so that `kubectl describe pod` shows every setting.

use crate::api::DataPipeline;
use crate::api::v1alpha1::{GpuPlacement, ResizeMode};
use kube::ResourceExt;

use super::{DECODER_GRPC_PORT, DECODER_METRICS_PORT};

/// S3 access shared by both roles; credentials come from the Secret through the environment.
fn s3_args(dp: &DataPipeline) -> Vec<String> {
    let s3 = &dp.spec.source.s3;
    let mut args = Vec::new();
    if let Some(endpoint) = &s3.endpoint {
        args.extend(["--endpoint".to_string(), endpoint.clone()]);
    }
    if let Some(region) = &s3.region {
        args.extend(["--region".to_string(), region.clone()]);
    }
    if s3.force_path_style {
        args.push("--force-path-style".to_string());
    }
    args
}

/// `stoker-loader decode`: stateless; every request carries its samples and transform.
pub fn decoder_args(dp: &DataPipeline) -> Vec<String> {
    let mut args: Vec<String> = [
        "decode".to_string(),
        "--grpc-addr".to_string(),
        format!("0.0.0.0:{DECODER_GRPC_PORT}"),
        "--http-addr".to_string(),
        format!("0.0.0.0:{DECODER_METRICS_PORT}"),
    ]
    .into();
    args.extend(s3_args(dp));
    args
}

/// `stoker-loader sidecar`: the epoch plan, the transform it asks decoders for, where to find
/// them (`decoder_selector` through the Kubernetes API), and the hand-off to the trainer.
pub fn sidecar_args(
    dp: &DataPipeline,
    decoder_selector: &str,
    socket: &str,
    shm_dir: &str,
    http_port: i32,
) -> Vec<String> {
    let spec = &dp.spec;
    let flag = |name: &str, value: String| [format!("--{name}"), value];
    let mut args = vec!["sidecar".to_string()];
    args.extend(flag("bucket", spec.source.s3.bucket.clone()));
    if let Some(prefix) = spec.source.s3.prefix.as_ref().filter(|p| !p.is_empty()) {
        args.extend(flag("prefix", prefix.clone()));
    }
    if let Some(manifest) = &spec.source.manifest {
        args.extend(flag("manifest", manifest.clone()));
    }
    args.extend(flag("batch-size", spec.batch.size.to_string()));
    match spec.batch.shuffle_seed {
        Some(seed) => args.extend(flag("seed", seed.to_string())),
        None => args.push("--no-shuffle".to_string()),
    }
    if spec.batch.drop_last {
        args.push("--drop-last".to_string());
    }
    args.extend(flag(
        "prefetch-batches",
        spec.trainer.prefetch_batches.to_string(),
    ));
    args.extend(flag("socket", socket.to_string()));
    args.extend(flag("shm-dir", shm_dir.to_string()));
    args.extend(flag("http-addr", format!("0.0.0.0:{http_port}")));
    args.extend(flag("workers-selector", decoder_selector.to_string()));
    args.extend(flag(
        "workers-namespace",
        dp.namespace().unwrap_or_default(),
    ));
    args.extend(flag("workers-port", DECODER_GRPC_PORT.to_string()));
    let placement = match spec.trainer.gpu_placement {
        GpuPlacement::Auto | GpuPlacement::Device => "auto",
        GpuPlacement::Host => "off",
    };
    args.extend(flag("gpu-placement", placement.to_string()));
    let resize = &spec.transform.resize;
    let mode = match resize.mode {
        ResizeMode::Crop => "crop",
        ResizeMode::Fit => "fit",
        ResizeMode::QwenSmart => "qwen-smart",
    };
    args.extend(flag("resize", mode.to_string()));
    let optional = [
        ("width", resize.width),
        ("height", resize.height),
        ("factor", resize.patch_factor),
        ("min-pixels", resize.min_pixels),
        ("max-pixels", resize.max_pixels),
    ];
    for (name, value) in optional {
        if let Some(v) = value {
            args.extend(flag(name, v.to_string()));
        }
    }
    args.extend(s3_args(dp));
    args
}
