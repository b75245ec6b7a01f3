//! Real components for stoker's tests and the local cluster.
//!
//! - [`cluster`]: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the KWOK
//!   controller on loopback, with simulated GPU and CPU nodes.
//! - [`s3`]: an S3 server (the `s3s-fs` crate) on loopback with signatures checked.

pub mod s3;
