//! GPU placement.
//!
//! Choice: the trainer registers the shared-memory ring as pinned memory once
//! (`cudaHostRegister`) and copies each batch to the device with `non_blocking=True`; the
//! sidecar does not copy batches into device buffers and hand out CUDA IPC handles. Why:
//! - the bytes are already in shared memory; pinning them in place costs one registration for
//!   the life of the ring (pinning per batch runs at ~1–2 GB/s, a registered ring copies at
//!   PCIe speed, ≥ 48 GB/s on H100/H200);
//! - IPC would add a device copy in the sidecar, a device allocation pool per ring slot, and a
//!   CUDA context in the sidecar on the trainer's GPU (memory the trainer wants), and IPC
//!   handles fail on stream-ordered allocations (cudarc #521);
//! - the trainer's copy runs on its own stream, overlapped with its compute.
//!
//! The sidecar only probes the driver (through cudarc with dynamic loading, so the binary runs
//! where CUDA is absent) and tells the trainer whether placement is on. Not checked on a GPU.

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuProbe {
    Available { devices: u32, driver_version: i32 },
    Unavailable { reason: String },
}

impl GpuProbe {
    pub fn is_available(&self) -> bool {
        matches!(self, GpuProbe::Available { .. })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("the CUDA driver library (libcuda.so) is not installed")]
    NoDriverLibrary,
    #[error("{call} failed: {detail}")]
    Driver { call: &'static str, detail: String },
    #[error("the CUDA driver reports no device")]
    NoDevice,
    #[error("the CUDA driver panicked in {call}")]
    Panicked { call: &'static str },
}

impl GpuError {
    pub fn category(&self) -> &'static str {
        match self {
            GpuError::NoDriverLibrary => "no_driver_library",
            GpuError::Driver { .. } => "driver",
            GpuError::NoDevice => "no_device",
            GpuError::Panicked { .. } => "panicked",
        }
    }
}

/// GPU placement setting (`--gpu-placement`): `auto` pins the ring when a GPU is found,
/// `host` never does.
pub use stoker_contract::GpuPlacement;

/// Looks for a usable CUDA driver and device. Never panics: no driver, no device or a driver
/// error all come back as `Unavailable` with the reason.
pub fn probe() -> GpuProbe {
    match try_probe() {
        Ok((devices, driver_version)) => GpuProbe::Available {
            devices,
            driver_version,
        },
        Err(e) => GpuProbe::Unavailable {
            reason: e.to_string(),
        },
    }
}

fn try_probe() -> Result<(u32, i32), GpuError> {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made when it is missing.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriverLibrary);
    }
    // cudarc panics on a driver library that lacks a symbol; that must not take the sidecar down.
    let guarded = |call: &'static str, f: &dyn Fn() -> Result<i64, cudarc::driver::DriverError>| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|_| GpuError::Panicked { call })?
            .map_err(|e| GpuError::Driver {
                call,
                detail: e.to_string(),
            })
    };
    guarded("cuInit", &|| result::init().map(|()| 0))?;
    let devices = guarded("cuDeviceGetCount", &|| {
        result::device::get_count().map(i64::from)
    })?;
    if devices <= 0 {
        return Err(GpuError::NoDevice);
    }
    let version = guarded("cuDriverGetVersion", &|| {
        let mut v = 0i32;
        // SAFETY: writes one int through a valid pointer.
        unsafe { sys::cuDriverGetVersion(&mut v) }
            .result()
            .map(|()| i64::from(v))
    })?;
    Ok((devices as u32, version as i32))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CI machines have no GPU: placement turns off with a reason instead of failing.
    #[test]
    fn probe_reports_unavailable_with_a_reason_without_a_gpu() {
        match probe() {
            GpuProbe::Unavailable { reason } => assert!(!reason.is_empty()),
            GpuProbe::Available { devices, .. } => assert!(devices > 0),
        }
        if std::path::Path::new("/dev/nvidia0").exists() {
            return;
        }
        assert!(
            !probe().is_available(),
            "no /dev/nvidia0 here, so no GPU should be found"
        );
    }
}
