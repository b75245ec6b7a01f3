//! Real components for stoker's tests and the local cluster.
//!
//! - [`cluster`]: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the KWOK
//!   controller on loopback, with simulated GPU and CPU nodes ([`nodes`]).
//! - [`s3`]: an S3 server (the `s3s-fs` crate) on loopback with signatures checked.
//! - [`runtime`]: runs the pods bound to simulated nodes as local processes, one network
//!   namespace per node with a rate-limited NIC; [`prometheus`]: a real Prometheus scraping them.
//! - [`audit`]: what the API server's audit log says an identity did.
//! - [`http`] and [`metrics`]: the one HTTP client and the one Prometheus text reader of the
//!   tests.

pub mod audit;
pub mod certs;
pub mod cluster;
pub mod http;
pub mod metrics;
pub mod net;
pub mod nodes;
pub mod process;
pub mod prometheus;
pub mod runtime;
pub mod s3;

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The directory of the package whose test is running, read when the test runs: `cargo test`
/// (and scripts/cargo-tests.py) set it. Not `env!("CARGO_MANIFEST_DIR")`: CI reuses one build
/// across fresh clones, and cargo does not rebuild a crate whose directory only moved, so a
/// compiled-in path would point at an earlier clone.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .expect("CARGO_MANIFEST_DIR is set: run the tests through cargo test")
}

/// Polls `check` every 200 ms until it returns `Some`, and panics with `what` after `timeout`:
/// how every end-to-end test waits for the cluster to converge.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
