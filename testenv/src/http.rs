//! The tests' one HTTP client: plain HTTP/1 requests to the servers they start on loopback and
//! on pod IPs (health, readiness, `/metrics`, Prometheus's API), through hyper's client.
//!
//! Every call opens its own connection and closes it: no pooled connection outlives a request,
//! so none keeps a draining server open or reaches a server that a test restarted.

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;
use std::time::Duration;

/// How long one request may take, from connecting to the last byte of the body.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// `GET http://{addr}{path}`: (status, body).
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    send("GET", &format!("http://{addr}{path}"), "").await
}

/// `GET` of a whole `http://` URL: (status, body).
pub async fn get_url(url: &str) -> Result<(u16, String)> {
    send("GET", url, "").await
}

/// `{method} http://{addr}{path}` with `body`: (status, body).
pub async fn request(
    method: &str,
    addr: SocketAddr,
    path: &str,
    body: &str,
) -> Result<(u16, String)> {
    send(method, &format!("http://{addr}{path}"), body).await
}

async fn send(method: &str, url: &str, body: &str) -> Result<(u16, String)> {
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let request = ::http::Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .with_context(|| format!("{method} {url}"))?;
    let exchange = async {
        let response = client.request(request).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .with_context(|| format!("{method} {url}: no answer within {TIMEOUT:?}"))?
        .with_context(|| format!("{method} {url}"))
}

/// The same requests for synchronous tests and start-up code. Each runs on a thread of its own
/// with its own runtime, so a caller may also be inside a tokio runtime.
pub mod blocking {
    use anyhow::{Result, anyhow};
    use std::net::SocketAddr;

    /// [`super::get`], blocking.
    pub fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
        on_own_runtime(super::get(addr, path))
    }

    /// [`super::request`], blocking.
    pub fn request(
        method: &str,
        addr: SocketAddr,
        path: &str,
        body: &str,
    ) -> Result<(u16, String)> {
        on_own_runtime(super::request(method, addr, path, body))
    }

    fn on_own_runtime<T: Send>(call: impl Future<Output = Result<T>> + Send) -> Result<T> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(call)
                })
                .join()
                .map_err(|_| anyhow!("HTTP request thread panicked"))?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot server answering `response` verbatim; returns its address and what it read.
    async fn one_shot(response: &'static str) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut chunk = [0u8; 1024];
            while !String::from_utf8_lossy(&request).contains("\r\n\r\n") {
                let n = socket.read(&mut chunk).await.unwrap();
                request.extend_from_slice(&chunk[..n]);
            }
            socket.write_all(response.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        (addr, served)
    }

    #[tokio::test]
    async fn get_returns_status_and_a_dechunked_body() {
        let (addr, served) = one_shot(
            "HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n\
             5\r\ndrain\r\n4\r\ning.\r\n0\r\n\r\n",
        )
        .await;
        let (status, body) = get(addr, "/readyz").await.unwrap();
        assert_eq!((status, body.as_str()), (503, "draining."));
        let request = served.await.unwrap();
        assert!(request.starts_with("GET /readyz HTTP/1.1\r\n"), "{request}");
    }

    #[test]
    fn blocking_works_inside_a_runtime() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (addr, served) =
            rt.block_on(one_shot("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"));
        let answer = rt.block_on(async { blocking::get(addr, "/healthz").unwrap() });
        assert_eq!(answer, (200, "ok".to_string()));
        rt.block_on(served).unwrap();
    }

    #[tokio::test]
    async fn a_refused_connection_is_an_error_naming_the_url() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = get(addr, "/metrics").await.unwrap_err();
        assert!(
            format!("{err:#}").contains(&format!("GET http://{addr}/metrics")),
            "{err:#}"
        );
    }
}
