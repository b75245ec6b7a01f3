//! Decoders serve only their pipeline's sidecars: real `stoker-loader decode` and `sidecar`
//! processes with certificates laid out as the operator's Secret mounts them (ca.crt, tls.crt,
//! tls.key), and clients that lack one, or hold another pipeline's.

mod common;
mod sidecar_support;

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use stoker_loader::worker::{DecodeClient, PipelineTls};
use stoker_testenv::s3::S3Server;
use tonic::codegen::http::Uri;
use tonic::transport::Endpoint;

const PIPELINE_A: &str = "a-decoders.training.svc";
const PIPELINE_B: &str = "b-decoders.training.svc";

/// The installation's CA, as the operator makes it.
fn ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, "stoker-pipeline-ca");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("ca")
}

/// Writes a pipeline's Secret as its volume shows it: the CA, and a certificate for `name`
/// usable as server and client.
fn write_pipeline_dir(dir: &Path, ca: &CertifiedIssuer<'static, KeyPair>, name: &str) {
    std::fs::create_dir_all(dir).expect("dir");
    let mut params = CertificateParams::new(vec![name.to_string()]).expect("params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, ca).expect("sign");
    // Written aside, then renamed in: readers never see half a file (the kubelet swaps a
    // symlink for the same reason).
    for (file, text) in [
        ("ca.crt", ca.pem()),
        ("tls.crt", cert.pem()),
        ("tls.key", key.serialize_pem()),
    ] {
        let tmp = dir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(file)).expect("rename");
    }
}

fn tls_flags<'a>(dir: &'a Path, name: &'a str) -> [&'a str; 4] {
    [
        "--tls-dir",
        dir.to_str().expect("utf-8 path"),
        "--tls-peer-name",
        name,
    ]
}

/// Decodes one batch of `keys` from the decoder at `grpc` with `client`.
async fn decode(
    client: Result<DecodeClient, tonic::transport::Error>,
    keys: &[&str],
) -> Result<usize, String> {
    let mut client = client.map_err(|e| format!("connect: {e:?}"))?;
    let reply = client
        .decode_batch(common::request(keys, common::crop(32, 32)))
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
    Ok(reply.samples.len())
}

async fn tls_client(
    grpc: &str,
    dir: &Path,
    name: &str,
) -> Result<DecodeClient, tonic::transport::Error> {
    let tls = PipelineTls::load(dir, name).expect("client certificates load");
    DecodeClient::connect_with(format!("http://{grpc}"), Some(tls)).await
}

/// TLS that trusts the CA but presents no certificate: what a pod in the namespace without the
/// pipeline's Secret could do.
#[derive(Clone)]
struct NoClientCert(Arc<rustls::ClientConfig>);

impl tonic::codegen::Service<Uri> for NoClientCert {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let config = self.0.clone();
        Box::pin(async move {
            let authority = uri.authority().expect("authority").to_string();
            let tcp = tokio::net::TcpStream::connect(authority).await?;
            let name = rustls::pki_types::ServerName::try_from(PIPELINE_A).expect("name");
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

async fn client_without_certificate(
    grpc: &str,
    ca_pem: &str,
) -> Result<DecodeClient, tonic::transport::Error> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("root");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let channel = Endpoint::from_shared(format!("http://{grpc}"))?
        .connect_with_connector(NoClientCert(Arc::new(config)))
        .await?;
    Ok(DecodeClient::from_channel(channel))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_client_with_the_pipelines_certificate_gets_a_batch_decoded() {
    let dir = tempfile::tempdir().expect("tmp");
    let server = S3Server::start(dir.path().join("s3")).expect("s3");
    server.create_bucket(common::BUCKET).expect("bucket");
    server
        .put_object(common::BUCKET, "a.jpg", &common::jpeg(64, 48))
        .expect("put");
    let ca = ca();
    let (decoder_dir, a_dir, b_dir) = (
        dir.path().join("decoder"),
        dir.path().join("a"),
        dir.path().join("b"),
    );
    write_pipeline_dir(&decoder_dir, &ca, PIPELINE_A);
    write_pipeline_dir(&a_dir, &ca, PIPELINE_A);
    write_pipeline_dir(&b_dir, &ca, PIPELINE_B);
    let decoder = common::spawn_decoder(
        &server,
        &[
            &["--bucket", common::BUCKET][..],
            &tls_flags(&decoder_dir, PIPELINE_A),
        ]
        .concat(),
    );
    let grpc = decoder.grpc.to_string();

    let decoded = decode(tls_client(&grpc, &a_dir, PIPELINE_A).await, &["a.jpg"]).await;
    assert_eq!(decoded, Ok(1), "pipeline a's sidecar certificate");

    let plaintext = decode(
        DecodeClient::connect(format!("http://{grpc}")).await,
        &["a.jpg"],
    )
    .await;
    assert!(plaintext.is_err(), "plaintext was served: {plaintext:?}");

    let ca_pem = std::fs::read_to_string(a_dir.join("ca.crt")).expect("ca");
    let no_cert = decode(client_without_certificate(&grpc, &ca_pem).await, &["a.jpg"]).await;
    assert!(
        no_cert.is_err(),
        "a TLS client without a certificate was served: {no_cert:?}"
    );

    // Pipeline b's certificate, from the same CA, by a client that accepts a's decoder: the
    // decoder refuses it in the handshake.
    let other = decode(tls_client(&grpc, &b_dir, PIPELINE_A).await, &["a.jpg"]).await;
    assert!(
        other.is_err(),
        "another pipeline's certificate was served: {other:?}"
    );

    // And b's sidecar does not take a's decoder for its own.
    let wrong_server = decode(tls_client(&grpc, &b_dir, PIPELINE_B).await, &["a.jpg"]).await;
    assert!(
        wrong_server.is_err(),
        "b's client accepted a's decoder: {wrong_server:?}"
    );

    // A certificate for a's name from another CA (another installation) is refused too.
    let foreign_dir = dir.path().join("foreign");
    write_pipeline_dir(&foreign_dir, &self::ca(), PIPELINE_A);
    let foreign = decode(
        tls_client(&grpc, &foreign_dir, PIPELINE_A).await,
        &["a.jpg"],
    )
    .await;
    assert!(
        foreign.is_err(),
        "a certificate of another CA was served: {foreign:?}"
    );

    // The refusals left the decoder serving its own pipeline.
    let again = decode(tls_client(&grpc, &a_dir, PIPELINE_A).await, &["a.jpg"]).await;
    assert_eq!(again, Ok(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificates_are_used_by_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let server = S3Server::start(dir.path().join("s3")).expect("s3");
    server.create_bucket(common::BUCKET).expect("bucket");
    server
        .put_object(common::BUCKET, "a.jpg", &common::jpeg(64, 48))
        .expect("put");
    let (decoder_dir, sidecar_dir, stale_dir) = (
        dir.path().join("decoder"),
        dir.path().join("sidecar"),
        dir.path().join("stale"),
    );
    let first = ca();
    write_pipeline_dir(&decoder_dir, &first, PIPELINE_A);
    write_pipeline_dir(&sidecar_dir, &first, PIPELINE_A);
    write_pipeline_dir(&stale_dir, &first, PIPELINE_A);
    let decoder = common::spawn_decoder(
        &server,
        &[
            &["--bucket", common::BUCKET][..],
            &tls_flags(&decoder_dir, PIPELINE_A),
        ]
        .concat(),
    );
    let pid = decoder.child.id();
    let grpc = decoder.grpc.to_string();
    let sidecar_tls = PipelineTls::load(&sidecar_dir, PIPELINE_A).expect("load");
    let connect =
        || DecodeClient::connect_with(format!("http://{grpc}"), Some(sidecar_tls.clone()));
    assert_eq!(decode(connect().await, &["a.jpg"]).await, Ok(1));

    // The operator rotates the CA (the hardest case: every certificate changes) and the
    // kubelet updates both Secret volumes.
    let second = ca();
    write_pipeline_dir(&decoder_dir, &second, PIPELINE_A);
    write_pipeline_dir(&sidecar_dir, &second, PIPELINE_A);

    assert_eq!(
        decode(connect().await, &["a.jpg"]).await,
        Ok(1),
        "a new connection with the new files"
    );
    let stale = decode(tls_client(&grpc, &stale_dir, PIPELINE_A).await, &["a.jpg"]).await;
    assert!(
        stale.is_err(),
        "the decoder still trusts the replaced CA, so it did not re-read its files: {stale:?}"
    );
    assert_eq!(decoder.child.id(), pid);
    let mut decoder = decoder;
    assert!(
        decoder.child.try_wait().expect("wait").is_none(),
        "the decoder kept running"
    );
}

#[test]
fn a_sidecar_with_its_pipelines_certificate_delivers_every_sample_from_the_decoder() {
    let dir = tempfile::tempdir().expect("tmp");
    let server = S3Server::start(dir.path().join("s3")).expect("s3");
    let keys = sidecar_support::dataset(&server, 12, 64, 48);
    let ca = ca();
    let (decoder_dir, sidecar_dir) = (dir.path().join("decoder"), dir.path().join("sidecar"));
    write_pipeline_dir(&decoder_dir, &ca, PIPELINE_A);
    write_pipeline_dir(&sidecar_dir, &ca, PIPELINE_A);
    let decoder = common::spawn_decoder(
        &server,
        &[
            &["--bucket", sidecar_support::BUCKET][..],
            &tls_flags(&decoder_dir, PIPELINE_A),
        ]
        .concat(),
    );
    let grpc = decoder.grpc.to_string();
    let sidecar = sidecar_support::sidecar(
        &server,
        dir.path(),
        &[],
        &[
            &["--workers", &grpc, "--no-local-fallback", "--epochs", "1"][..],
            &tls_flags(&sidecar_dir, PIPELINE_A),
        ]
        .concat(),
    );
    let mut trainer = sidecar.connect();
    let epoch = sidecar_support::consume_epoch(&mut trainer, |_, _| {});
    let mut got = epoch.keys();
    got.sort();
    let mut want = keys.clone();
    want.sort();
    assert_eq!(got, want, "every sample once");
    assert!(epoch.skips.is_empty(), "skips: {:?}", epoch.skips);
    let served = stoker_testenv::http::blocking::get(decoder.http, "/metrics")
        .expect("decoder metrics")
        .1;
    let decoded = common::metric(&served, "stoker_loader_samples_out_total");
    assert_eq!(
        decoded, 12.0,
        "the decoder decoded the epoch over mutual TLS"
    );
}
