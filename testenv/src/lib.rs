//! Real components for stoker's tests and the local cluster.
//!
//! - [`cluster`]: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the KWOK
//!   controller on loopback, with simulated GPU and CPU nodes ([`nodes`]).
//! - [`s3`]: an S3 server (the `s3s-fs` crate) on loopback with signatures checked.
//! - [`runtime`]: runs the pods bound to simulated nodes as local processes, one network
//!   namespace per node with a rate-limited NIC; [`prometheus`]: a real Prometheus scraping them.

pub mod certs;
pub mod cluster;
pub mod nodes;
pub mod process;
pub mod prometheus;
pub mod runtime;
pub mod s3;
