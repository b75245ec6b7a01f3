//! Where the decode workers are. The fleet re-asks its discovery every interval, so workers
//! that the operator adds, drains or removes are picked up without restarting the trainer.
//!
//! - [`StaticWorkers`]: a fixed list (`--workers`).
//! - [`DnsWorkers`]: a name re-resolved each time (a headless Service: one A record per pod).
//! - [`kube::KubeWorkers`]: the decoder pods from the Kubernetes API (label selector, Ready,
//!   not labelled `stoker.dev/draining=true`). The kube dependency stays in that one file.

pub mod kube;

use std::future::Future;
use std::pin::Pin;

pub use self::kube::KubeWorkers;

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("resolving {name}: {source}")]
    Dns {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("listing pods in {namespace} with {selector}: {detail}")]
    Kube {
        namespace: String,
        selector: String,
        detail: String,
    },
}

impl DiscoveryError {
    pub fn category(&self) -> &'static str {
        match self {
            DiscoveryError::Dns { .. } => "dns",
            DiscoveryError::Kube { .. } => "kube",
        }
    }
}

pub type DiscoveryFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<String>, DiscoveryError>> + Send + 'a>>;

/// A source of decode worker endpoints (`http://host:port`).
pub trait WorkerDiscovery: Send + Sync {
    /// Short name for logs.
    fn describe(&self) -> String;
    /// The workers that should receive batches now.
    fn discover(&self) -> DiscoveryFuture<'_>;
}

/// A fixed list of endpoints.
#[derive(Debug, Clone)]
pub struct StaticWorkers(pub Vec<String>);

impl WorkerDiscovery for StaticWorkers {
    fn describe(&self) -> String {
        format!("static list of {}", self.0.len())
    }

    fn discover(&self) -> DiscoveryFuture<'_> {
        let list = self.0.iter().map(|e| with_scheme(e)).collect();
        Box::pin(async move { Ok(list) })
    }
}

/// Every address a DNS name resolves to, on one port.
#[derive(Debug, Clone)]
pub struct DnsWorkers {
    pub name: String,
    pub port: u16,
}

impl WorkerDiscovery for DnsWorkers {
    fn describe(&self) -> String {
        format!("dns {}:{}", self.name, self.port)
    }

    fn discover(&self) -> DiscoveryFuture<'_> {
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((self.name.as_str(), self.port))
                .await
                .map_err(|source| DiscoveryError::Dns {
                    name: self.name.clone(),
                    source,
                })?;
            let mut out: Vec<String> = addrs.map(|a| format!("http://{a}")).collect();
            out.sort();
            out.dedup();
            Ok(out)
        })
    }
}

/// Accepts `host:port` as well as `http://host:port`.
pub fn with_scheme(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn static_and_dns_discovery() {
        let s = StaticWorkers(vec!["127.0.0.1:1".into(), "http://h:2".into()]);
        assert_eq!(
            s.discover().await.unwrap(),
            vec!["http://127.0.0.1:1", "http://h:2"]
        );
        let d = DnsWorkers {
            name: "localhost".into(),
            port: 50051,
        };
        let found = d.discover().await.unwrap();
        assert!(found.iter().any(|e| e.ends_with(":50051")), "{found:?}");
        let bad = DnsWorkers {
            name: "no-such-host.invalid".into(),
            port: 1,
        };
        assert_eq!(bad.discover().await.unwrap_err().category(), "dns");
    }
}
