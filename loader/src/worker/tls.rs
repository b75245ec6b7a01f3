//! Mutual TLS between sidecars and decoders. Both ends hold the pipeline's certificate (one
//! leaf per pipeline, server and client use), issued by the operator from the installation's
//! CA, and accept a peer only when its certificate chains to that CA and is valid for the
//! pipeline's name (its decoder Service, `<service>.<namespace>.svc`): a certificate of another
//! pipeline of the same installation is refused during the handshake, before any request.
//!
//! The files are read again for every new connection and the rustls configs rebuilt when their
//! bytes changed, so a rotated Secret (the kubelet swaps the mounted files) is used by the next
//! connection without a restart; established connections keep their session.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tonic::transport::server::{Connected, TcpConnectInfo};

use stoker_contract::{TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE, TlsArgs};

/// Longest TLS handshake a decoder waits for; a peer that stalls is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// gRPC is HTTP/2 only.
const ALPN_H2: &[u8] = b"h2";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading TLS file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("TLS file {path}: {detail}")]
    Pem { path: PathBuf, detail: String },
    #[error("--tls-peer-name {name:?} is not a DNS name")]
    PeerName { name: String },
    #[error("TLS configuration from {dir}: {detail}")]
    Config { dir: PathBuf, detail: String },
}

impl TlsError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Read { .. } => "tls_read",
            Self::Pem { .. } => "tls_pem",
            Self::PeerName { .. } => "tls_peer_name",
            Self::Config { .. } => "tls_config",
        }
    }
}

/// The bytes of the three files and the configs built from them.
struct Loaded {
    files: [Vec<u8>; 3],
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

/// A pipeline's certificate directory and the name its peers must carry.
pub struct PipelineTls {
    dir: PathBuf,
    peer_name: ServerName<'static>,
    loaded: Mutex<Option<Arc<Loaded>>>,
}

impl std::fmt::Debug for PipelineTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineTls")
            .field("dir", &self.dir)
            .field("peer_name", &self.peer_name)
            .finish_non_exhaustive()
    }
}

impl PipelineTls {
    /// Reads the directory once, so that a missing or bad file fails at start.
    pub fn load(dir: impl Into<PathBuf>, peer_name: &str) -> Result<Arc<Self>, TlsError> {
        let peer_name = ServerName::try_from(peer_name.to_string())
            .ok()
            .filter(|n| matches!(n, ServerName::DnsName(_)))
            .ok_or_else(|| TlsError::PeerName {
                name: peer_name.to_string(),
            })?;
        let tls = Arc::new(Self {
            dir: dir.into(),
            peer_name,
            loaded: Mutex::new(None),
        });
        tls.current()?;
        Ok(tls)
    }

    /// From `--tls-dir` and `--tls-peer-name`; None when unset (plaintext, with a warning).
    pub fn from_args(args: &TlsArgs) -> Result<Option<Arc<Self>>, TlsError> {
        match (&args.tls_dir, &args.tls_peer_name) {
            (Some(dir), Some(name)) => Self::load(dir.clone(), name).map(Some),
            _ => {
                tracing::warn!("no --tls-dir: decode RPCs are plaintext and unauthenticated");
                Ok(None)
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configs of the files as they are now: rebuilt when a file changed. A changed set
    /// that does not load (a half-written directory outside Kubernetes) keeps the previous one.
    fn current(&self) -> Result<Arc<Loaded>, TlsError> {
        let previous = self
            .loaded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let files = match self.read_files() {
            Ok(files) => files,
            Err(err) => return previous.ok_or(err),
        };
        if let Some(p) = previous.as_ref().filter(|p| p.files == files) {
            return Ok(p.clone());
        }
        let loaded = match self.build(files) {
            Ok(loaded) => Arc::new(loaded),
            Err(err) => {
                return match previous {
                    Some(p) => {
                        tracing::warn!(%err, "new TLS files do not load; keeping the previous ones");
                        Ok(p)
                    }
                    None => Err(err),
                };
            }
        };
        if previous.is_some() {
            tracing::info!(dir = %self.dir.display(), "TLS certificates changed; new connections use them");
        }
        *self
            .loaded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(loaded.clone());
        Ok(loaded)
    }

    fn read_files(&self) -> Result<[Vec<u8>; 3], TlsError> {
        let read = |name: &str| {
            let path = self.dir.join(name);
            std::fs::read(&path).map_err(|source| TlsError::Read { path, source })
        };
        Ok([
            read(TLS_CA_FILE)?,
            read(TLS_CERT_FILE)?,
            read(TLS_KEY_FILE)?,
        ])
    }

    fn build(&self, files: [Vec<u8>; 3]) -> Result<Loaded, TlsError> {
        let pem_err = |name: &str, detail: String| TlsError::Pem {
            path: self.dir.join(name),
            detail,
        };
        let certs = |bytes: &[u8], name: &str| {
            let certs = CertificateDer::pem_slice_iter(bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| pem_err(name, e.to_string()))?;
            if certs.is_empty() {
                return Err(pem_err(name, "no certificate".into()));
            }
            Ok(certs)
        };
        let ca = certs(&files[0], TLS_CA_FILE)?;
        let chain = certs(&files[1], TLS_CERT_FILE)?;
        let key = || {
            PrivateKeyDer::from_pem_slice(&files[2])
                .map_err(|e| pem_err(TLS_KEY_FILE, e.to_string()))
        };
        let config_err = |detail: String| TlsError::Config {
            dir: self.dir.clone(),
            detail,
        };
        let mut roots = RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| pem_err(TLS_CA_FILE, e.to_string()))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());

        let chain_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|e| config_err(e.to_string()))?;
        let verifier = Arc::new(SamePipeline {
            chain: chain_verifier,
            name: self.peer_name.clone(),
        });
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| config_err(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key()?)
            .map_err(|e| config_err(e.to_string()))?;
        server.alpn_protocols = vec![ALPN_H2.to_vec()];

        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config_err(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key()?)
            .map_err(|e| config_err(e.to_string()))?;
        client.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Loaded {
            files,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }

    /// Accepts TCP connections and completes their handshakes concurrently (a peer that stalls
    /// its handshake holds up nobody), yielding those that pass for the gRPC server.
    pub fn incoming(self: Arc<Self>, listener: TcpListener) -> Incoming {
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<PeerStream>>(64);
        let accept = tokio::spawn(async move {
            loop {
                let (tcp, remote) = match listener.accept().await {
                    Ok(conn) => conn,
                    Err(err) => {
                        tracing::warn!(%err, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let tls = self.clone();
                let verified = tx.clone();
                tokio::spawn(async move {
                    match tls.handshake(tcp, remote).await {
                        Ok(stream) => {
                            let _ = verified.send(Ok(stream)).await;
                        }
                        Err(err) => {
                            tracing::info!(peer = %remote, %err, "TLS handshake refused");
                        }
                    }
                });
                if tx.is_closed() {
                    return;
                }
            }
        });
        Incoming {
            connections: rx,
            _accept: AbortOnDrop(accept),
        }
    }

    async fn handshake(&self, tcp: TcpStream, remote: SocketAddr) -> io::Result<PeerStream> {
        let config = self.current().map_err(io::Error::other)?.server.clone();
        let local = tcp.local_addr().ok();
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, TlsAcceptor::from(config).accept(tcp))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        Ok(PeerStream {
            inner: stream,
            info: TcpConnectInfo {
                local_addr: local,
                remote_addr: Some(remote),
            },
        })
    }

    /// Connects to a decoder at `addr` and checks that it serves this pipeline.
    pub async fn connect(
        &self,
        addr: &str,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let config = self.current().map_err(io::Error::other)?.client.clone();
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        TlsConnector::from(config)
            .connect(self.peer_name.clone(), tcp)
            .await
    }
}

/// Chains to the CA (rustls' WebPKI verifier) and names this pipeline.
#[derive(Debug)]
struct SamePipeline {
    chain: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for SamePipeline {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.chain
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::NotValidForName))?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

/// An accepted, verified connection, as tonic's server takes it (`remote_addr()` works).
pub struct PeerStream {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    info: TcpConnectInfo,
}

impl Connected for PeerStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Stops the accept loop when the server drops its incoming stream.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The verified connections, for as long as the server holds it.
pub struct Incoming {
    connections: tokio::sync::mpsc::Receiver<io::Result<PeerStream>>,
    _accept: AbortOnDrop,
}

impl futures::Stream for Incoming {
    type Item = io::Result<PeerStream>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.connections.poll_recv(cx)
    }
}

/// tonic's connector for decoders: TCP, then TLS with the pipeline's current certificate.
#[derive(Clone, Debug)]
pub struct TlsChannelConnector {
    pub tls: Arc<PipelineTls>,
}

impl tonic::codegen::Service<tonic::codegen::http::Uri> for TlsChannelConnector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: tonic::codegen::http::Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let authority = uri.authority().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("decoder endpoint {uri} has no host:port"),
                )
            })?;
            let port = authority
                .port_u16()
                .unwrap_or(stoker_contract::DECODER_GRPC_PORT);
            let addr = format!("{}:{port}", authority.host());
            Ok(TokioIo::new(tls.connect(&addr).await?))
        })
    }
}
