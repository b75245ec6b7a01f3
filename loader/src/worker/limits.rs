//! Sizes a decoder checks before it allocates: decode threads from the container's CPU limit,
//! and the reply a batch would need against the gRPC message limit.

use std::path::Path;

use stoker_contract::{MAX_BATCH_PIXEL_BYTES, ResizeMode};

use crate::transform::Transform;

/// cgroup v2's CPU quota of this container.
pub const CGROUP_CPU_MAX: &str = "/sys/fs/cgroup/cpu.max";

/// CPUs a cgroup v2 `cpu.max` (`"<quota> <period>"` or `"max <period>"`) allows, rounded up:
/// a 1.5 CPU limit runs two threads. `None` when there is no quota or the text is not one.
pub fn cgroup_cpus(cpu_max: &str) -> Option<usize> {
    let mut fields = cpu_max.split_whitespace();
    let quota: u64 = fields.next()?.parse().ok()?;
    let period: u64 = fields.next().map_or(Some(100_000), |p| p.parse().ok())?;
    if quota == 0 || period == 0 {
        return None;
    }
    usize::try_from(quota.div_ceil(period)).ok()
}

/// Decode threads: `configured` when set, else the CPU limit in `cpu_max_file`, else the
/// cores the process may run on. Without this a decoder limited to 2 CPUs on a 64-core node
/// would start 64 threads, and hold 64 decoded samples at once.
pub fn decode_threads(configured: usize, cpu_max_file: &Path) -> usize {
    if configured > 0 {
        return configured;
    }
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::fs::read_to_string(cpu_max_file)
        .ok()
        .and_then(|text| cgroup_cpus(&text))
        .map_or(available, |cpus| cpus.min(available).max(1))
}

/// Largest output of one sample: the fixed size of crop and fit, `max_pixels` for qwenSmart.
pub fn max_output_pixels(transform: &Transform) -> u64 {
    let args = transform.to_args();
    match args.resize {
        ResizeMode::QwenSmart => args.max_pixels,
        ResizeMode::Crop | ResizeMode::Fit => u64::from(args.width) * u64::from(args.height),
    }
}

/// The pixel bytes a batch of `samples` may need, if it fits one reply: refused before any
/// GET or allocation otherwise (a reply over the message limit would fail after the work).
pub fn reply_pixel_bytes(samples: usize, transform: &Transform) -> Result<u64, u64> {
    let bytes = (samples as u64)
        .saturating_mul(max_output_pixels(transform))
        .saturating_mul(3);
    if bytes <= MAX_BATCH_PIXEL_BYTES {
        Ok(bytes)
    } else {
        Err(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_contract::{LoaderCommand, SidecarArgs, TransformArgs};

    #[test]
    fn reads_the_cgroup_cpu_quota() {
        assert_eq!(cgroup_cpus("200000 100000\n"), Some(2));
        assert_eq!(cgroup_cpus("150000 100000"), Some(2));
        assert_eq!(cgroup_cpus("50000 100000"), Some(1));
        assert_eq!(cgroup_cpus("max 100000\n"), None);
        assert_eq!(cgroup_cpus(""), None);
        assert_eq!(cgroup_cpus("0 100000"), None);
        assert_eq!(cgroup_cpus("garbage"), None);
    }

    #[test]
    fn threads_follow_a_fake_cgroup_file() {
        let dir = std::env::temp_dir().join(format!("stoker-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cpu.max");
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::fs::write(&file, "100000 100000\n").unwrap();
        assert_eq!(decode_threads(0, &file), 1);
        std::fs::write(&file, "max 100000\n").unwrap();
        assert_eq!(decode_threads(0, &file), available);
        // A quota above the machine's cores cannot run more threads than there are cores.
        std::fs::write(&file, "100000000 100000\n").unwrap();
        assert_eq!(decode_threads(0, &file), available);
        assert_eq!(decode_threads(3, &file), 3, "--threads wins");
        assert_eq!(decode_threads(0, &dir.join("absent")), available);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn transform(flags: &[&str]) -> Transform {
        let args: TransformArgs =
            SidecarArgs::parse_flags(["--bucket", "b"].iter().chain(flags).copied())
                .expect("flags")
                .transform;
        Transform::from_args(&args).expect("transform")
    }

    #[test]
    fn a_reply_over_the_message_limit_is_known_before_decoding() {
        let crop = transform(&["--width", "448", "--height", "448"]);
        assert_eq!(reply_pixel_bytes(32, &crop), Ok(32 * 448 * 448 * 3));
        assert!(reply_pixel_bytes(1024, &crop).is_err(), "616 MB > 240 MiB");
        let qwen = transform(&["--resize", "qwenSmart", "--max-pixels", "1003520"]);
        assert_eq!(max_output_pixels(&qwen), 1_003_520);
        assert!(reply_pixel_bytes(16, &qwen).is_ok());
        assert!(reply_pixel_bytes(100, &qwen).is_err());
    }
}
