//! An S3 server for tests, benches and the demo: the `s3s-fs` crate's file-system backend behind
//! `s3s`, with SigV4 signatures checked, on loopback.
//!
//! Buckets are directories under the root and objects are files, so a test can lay out data by
//! writing files ([`S3Server::put_object`]). Two things differ from the stock `s3s-fs` binary:
//! every accepted socket gets TCP_NODELAY (without it, responses on a reused keep-alive
//! connection wait for the client's delayed ACK, ~35 ms per GET), and a fault switch
//! ([`S3Server::fail_next`]) makes the next requests fail the way a throttled S3 does.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context as _;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::{S3Service, S3ServiceBuilder};
use tokio::net::TcpListener;

/// Default credentials of the test server; tests and the bench pass them explicitly.
pub const DEFAULT_ACCESS_KEY: &str = "stoker-test-access";
pub const DEFAULT_SECRET_KEY: &str = "stoker-test-secret";

/// Faults injected ahead of the real service. Shared between the handle and the connections.
#[derive(Default)]
struct Faults {
    /// Requests still to fail.
    remaining: AtomicU64,
    /// HTTP status of the injected failures.
    status: AtomicU64,
    /// Requests seen in total and requests failed on purpose (for assertions).
    seen: AtomicU64,
    injected: AtomicU64,
    /// Object GETs fail with this status until the deadline (an outage, a revoked key).
    gets: std::sync::Mutex<Option<(std::time::Instant, u16)>>,
}

impl Faults {
    /// The failure for `req`, if one is injected: the next-`n` switch first, then the GET
    /// outage (object GETs only: listings still answer, as when a key loses `s3:GetObject`).
    fn for_request<B>(&self, req: &http::Request<B>) -> Option<u16> {
        if let Some(status) = self.take() {
            return Some(status);
        }
        let outage = *self.gets.lock().unwrap_or_else(|e| e.into_inner());
        let (until, status) = outage?;
        let object_get = req.method() == http::Method::GET
            && req.uri().path().trim_start_matches('/').contains('/')
            && !req.uri().query().unwrap_or("").contains("list-type");
        (object_get && std::time::Instant::now() < until).then(|| {
            self.injected.fetch_add(1, Ordering::SeqCst);
            status
        })
    }

    /// Takes one injected failure if any is left.
    fn take(&self) -> Option<u16> {
        let mut cur = self.remaining.load(Ordering::SeqCst);
        while cur > 0 {
            match self
                .remaining
                .compare_exchange(cur, cur - 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    self.injected.fetch_add(1, Ordering::SeqCst);
                    return Some(self.status.load(Ordering::SeqCst) as u16);
                }
                Err(now) => cur = now,
            }
        }
        None
    }
}

/// Options of a server started in-process or by the `stoker-s3` binary.
#[derive(Debug, Clone)]
pub struct S3ServerConfig {
    pub root: PathBuf,
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    pub access_key: String,
    pub secret_key: String,
}

impl S3ServerConfig {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            host: "127.0.0.1".into(),
            port: 0,
            access_key: DEFAULT_ACCESS_KEY.into(),
            secret_key: DEFAULT_SECRET_KEY.into(),
        }
    }
}

/// A running S3 server. It lives on its own thread with its own tokio runtime, so it outlives the
/// per-test runtimes of `#[tokio::test]`; dropping the handle stops it.
pub struct S3Server {
    addr: SocketAddr,
    config: S3ServerConfig,
    faults: Arc<Faults>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl S3Server {
    /// Starts a server over `root` with the default test credentials on a free loopback port.
    pub fn start(root: impl Into<PathBuf>) -> anyhow::Result<Self> {
        Self::start_with(S3ServerConfig::new(root))
    }

    pub fn start_with(config: S3ServerConfig) -> anyhow::Result<Self> {
        let std_listener = std::net::TcpListener::bind((config.host.as_str(), config.port))
            .with_context(|| format!("binding {}:{}", config.host, config.port))?;
        Self::start_on(config, std_listener)
    }

    /// Serves on a listener the caller bound, e.g. inside a network namespace (the node
    /// runtime's S3 namespace); `config.host` and `config.port` are not used.
    pub fn start_on(
        config: S3ServerConfig,
        std_listener: std::net::TcpListener,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&config.root)
            .with_context(|| format!("creating S3 root {}", config.root.display()))?;
        let service = build_service(&config)?;
        let faults = Arc::new(Faults::default());
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let thread_faults = faults.clone();
        let thread = std::thread::Builder::new()
            .name("stoker-s3".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(err) => {
                        tracing::error!(%err, "S3 server runtime");
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(err) => {
                            tracing::error!(%err, "S3 server listener");
                            return;
                        }
                    };
                    tokio::select! {
                        () = serve(listener, service, thread_faults) => {}
                        _ = stop_rx => {}
                    }
                });
            })?;
        Ok(Self {
            addr,
            config,
            faults,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`; use path-style addressing.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn access_key(&self) -> &str {
        &self.config.access_key
    }

    pub fn secret_key(&self) -> &str {
        &self.config.secret_key
    }

    pub fn root(&self) -> &Path {
        &self.config.root
    }

    /// Creates a bucket (a directory under the root).
    pub fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        std::fs::create_dir_all(self.config.root.join(bucket))?;
        Ok(())
    }

    /// Writes an object straight to the backing file system; visible to the next request.
    pub fn put_object(&self, bucket: &str, key: &str, body: &[u8]) -> anyhow::Result<()> {
        let path = self.config.root.join(bucket).join(key);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Writes an object of `len` bytes that is a hole on disk (a sparse file: free to make at
    /// any size), with its ETag stored beside it as the server keeps one for a PUT, so that
    /// a GET does not first hash every byte of it (s3s-fs computes a missing ETag).
    pub fn put_sparse_object(&self, bucket: &str, key: &str, len: u64) -> anyhow::Result<()> {
        use base64::Engine;
        self.put_object(bucket, key, &[])?;
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.config.root.join(bucket).join(key))?
            .set_len(len)?;
        let encode = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let info = self.config.root.join(format!(
            ".bucket-{}.object-{}.internal.json",
            encode(bucket),
            encode(key)
        ));
        std::fs::write(info, r#"{"e_tag":"\"sparse\""}"#)?;
        Ok(())
    }

    /// The next `n` requests, whatever they are, fail with `status` (503 answers with the
    /// `SlowDown` error body S3 uses when it throttles; other codes with `InternalError`).
    pub fn fail_next(&self, n: u64, status: u16) {
        self.faults
            .status
            .store(u64::from(status), Ordering::SeqCst);
        self.faults.remaining.store(n, Ordering::SeqCst);
    }

    /// Every object GET fails with `status` for `duration` (503 as throttling, 403 as a
    /// revoked key); listings keep answering.
    pub fn fail_gets_for(&self, duration: std::time::Duration, status: u16) {
        *self.faults.gets.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now() + duration, status));
    }

    /// Requests received so far, injected failures included.
    pub fn requests_seen(&self) -> u64 {
        self.faults.seen.load(Ordering::SeqCst)
    }

    /// Failures injected so far.
    pub fn failures_injected(&self) -> u64 {
        self.faults.injected.load(Ordering::SeqCst)
    }

    /// Blocks until the server stops (for the binary).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn build_service(config: &S3ServerConfig) -> anyhow::Result<S3Service> {
    let fs = s3s_fs::FileSystem::new(&config.root)
        .map_err(|e| anyhow::anyhow!("s3s-fs over {}: {e:?}", config.root.display()))?;
    let mut builder = S3ServiceBuilder::new(fs);
    builder.set_auth(SimpleAuth::from_single(
        config.access_key.clone(),
        config.secret_key.clone(),
    ));
    Ok(builder.build())
}

async fn serve(listener: TcpListener, service: S3Service, faults: Arc<Faults>) {
    let http = ConnBuilder::new(TokioExecutor::new());
    loop {
        let (socket, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(err) => {
                tracing::warn!(%err, "accepting S3 connection");
                continue;
            }
        };
        // See the module comment: without this every keep-alive GET waits on a delayed ACK.
        let _ = socket.set_nodelay(true);
        let service = service.clone();
        let faults = faults.clone();
        let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let service = service.clone();
            let faults = faults.clone();
            async move {
                faults.seen.fetch_add(1, Ordering::SeqCst);
                if let Some(status) = faults.for_request(&req) {
                    return Ok(fault_response(status));
                }
                hyper::service::Service::call(&service, req).await
            }
        });
        let conn = http
            .serve_connection(TokioIo::new(socket), svc)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}

fn fault_response(status: u16) -> http::Response<s3s::Body> {
    let (code, message) = if status == 503 {
        ("SlowDown", "Please reduce your request rate.")
    } else if status == 403 {
        ("AccessDenied", "Access Denied")
    } else {
        (
            "InternalError",
            "We encountered an internal error. Please try again.",
        )
    };
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message><RequestId>stoker-fault</RequestId></Error>"
    );
    let mut resp = http::Response::new(s3s::Body::from(body));
    *resp.status_mut() =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::SERVICE_UNAVAILABLE);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    resp
}
