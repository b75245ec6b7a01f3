//! The S3 client: listing, manifests and GETs. The SDK's own retries are off so that every
//! retry and every throttle is counted here (the autoscaler reads them) and the backoff is ours:
//! full-jitter exponential, on 5xx, 429/503 SlowDown, timeouts and broken connections.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_smithy_http_client::tls;
use bytes::Bytes;
use tokio::sync::Semaphore;

use super::{ManifestLocation, SampleRef, SourceError, parse_manifest};
use crate::metrics::LoaderMetrics;
pub use crate::retry::RetryPolicy;
use crate::retry::{GaveUp, Outcome};

/// Static credentials for tests and S3-compatible stores; production uses the AWS chain
/// (environment, profile, web identity, instance metadata). Never printed.
#[derive(Clone)]
pub struct StaticCredentials {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for StaticCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticCredentials")
            .field("access_key_id", &"<redacted>")
            .field("secret_access_key", &"<redacted>")
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct S3Config {
    /// S3-compatible endpoint (`http://minio:9000`); None for AWS.
    pub endpoint: Option<String>,
    /// None: from the environment/profile, else us-east-1.
    pub region: Option<String>,
    pub force_path_style: bool,
    /// None: the standard AWS credential chain.
    pub credentials: Option<StaticCredentials>,
    /// GETs in flight at once, across all batches.
    pub max_concurrent_gets: usize,
    pub retry: RetryPolicy,
    /// Limit of one attempt (connect + response + body).
    pub attempt_timeout: Duration,
    /// Most bytes a sample's GET may answer with ([`S3Source::get_sample`]).
    pub max_object_bytes: u64,
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: None,
            force_path_style: false,
            credentials: None,
            max_concurrent_gets: 64,
            retry: RetryPolicy::default(),
            attempt_timeout: Duration::from_secs(30),
            max_object_bytes: stoker_contract::DEFAULT_MAX_OBJECT_BYTES,
        }
    }
}

/// Outcome class of one failed attempt.
enum Attempt {
    NotFound,
    /// 416: the range starts past the object's end (a shard shorter than its index says).
    RangeNotSatisfiable,
    Throttled,
    Retry {
        status: u16,
        detail: String,
    },
    AccessDenied(u16),
    /// The answer announces more bytes than a sample may have.
    TooLarge {
        bytes: u64,
        limit: u64,
    },
    Fatal(String),
}

fn classify<E: ProvideErrorMetadata + std::error::Error + 'static>(
    err: &SdkError<E, aws_smithy_runtime_api::client::orchestrator::HttpResponse>,
) -> Attempt {
    match err {
        SdkError::ServiceError(ctx) => {
            let status = ctx.raw().status().as_u16();
            let code = ctx.err().code().unwrap_or_default();
            if code == "NoSuchBucket" {
                Attempt::AccessDenied(status)
            } else if status == 416 || code == "InvalidRange" {
                Attempt::RangeNotSatisfiable
            } else if status == 404 || code == "NoSuchKey" {
                Attempt::NotFound
            } else if status == 503 || status == 429 || code == "SlowDown" {
                Attempt::Throttled
            } else if status >= 500 || code == "RequestTimeout" {
                Attempt::Retry {
                    status,
                    detail: code.to_string(),
                }
            } else if status == 401 || status == 403 {
                Attempt::AccessDenied(status)
            } else {
                Attempt::Fatal(DisplayErrorContext(err).to_string())
            }
        }
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            Attempt::Retry {
                status: 0,
                detail: DisplayErrorContext(err).to_string(),
            }
        }
        _ => Attempt::Fatal(DisplayErrorContext(err).to_string()),
    }
}

/// The `Range` header of `range` (inclusive end, as HTTP has it).
fn range_header(range: Option<&std::ops::Range<u64>>) -> Option<String> {
    range.map(|r| format!("bytes={}-{}", r.start, r.end.max(r.start + 1) - 1))
}

/// The announced length and `limit` when the one exceeds the other.
fn over(content_length: Option<i64>, limit: Option<u64>) -> Option<(u64, u64)> {
    let bytes = u64::try_from(content_length?).ok()?;
    let limit = limit?;
    (bytes > limit).then_some((bytes, limit))
}

impl Attempt {
    /// Throttling and transient failures are tried again; the rest is final.
    fn retried<T>(self) -> Outcome<T, Attempt> {
        match self {
            Attempt::Throttled | Attempt::Retry { .. } => Outcome::Retry(self),
            _ => Outcome::Final(self),
        }
    }
}

/// A connected S3 client with its GET limiter. Cheap to clone.
#[derive(Clone)]
pub struct S3Source {
    client: aws_sdk_s3::Client,
    gets: Arc<Semaphore>,
    retry: RetryPolicy,
    metrics: Arc<LoaderMetrics>,
    max_object_bytes: u64,
}

impl std::fmt::Debug for S3Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Source").finish_non_exhaustive()
    }
}

impl S3Source {
    pub async fn connect(config: &S3Config, metrics: Arc<LoaderMetrics>) -> S3Source {
        // hyper 1 + rustls/ring; TCP_NODELAY is on by default in this connector.
        let http_client = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        // Without an explicit region the loader's own chain (environment, profile, instance
        // metadata) runs with the client above; S3-compatible stores default to us-east-1.
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http_client);
        if let Some(r) = &config.region {
            loader = loader.region(Region::new(r.clone()));
        }
        if let Some(c) = &config.credentials {
            loader = loader.credentials_provider(Credentials::new(
                c.access_key_id.clone(),
                c.secret_access_key.clone(),
                None,
                None,
                "stoker-static",
            ));
        }
        let shared = loader.load().await;
        let mut builder = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(config.force_path_style)
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .operation_attempt_timeout(config.attempt_timeout)
                    .build(),
            )
            // Checksums cost CPU on every byte and S3-compatible stores differ on them.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if shared.region().is_none() {
            builder = builder.region(Region::new("us-east-1"));
        }
        if let Some(ep) = &config.endpoint {
            builder = builder.endpoint_url(ep);
        }
        S3Source {
            client: aws_sdk_s3::Client::from_conf(builder.build()),
            gets: Arc::new(Semaphore::new(config.max_concurrent_gets.max(1))),
            retry: config.retry,
            metrics,
            max_object_bytes: config.max_object_bytes,
        }
    }

    pub fn client(&self) -> &aws_sdk_s3::Client {
        &self.client
    }

    /// GETs one object whole, retrying transient failures. 404 is final.
    pub async fn get(&self, bucket: &str, key: &str) -> Result<Bytes, SourceError> {
        self.get_range(bucket, key, None).await
    }

    /// GETs one sample (`range` of its object, or all of it), at most the configured
    /// `max_object_bytes`: a larger answer is [`SourceError::TooLarge`] from its Content-Length,
    /// before any of its body is read, so a crafted 5 GB object costs no memory.
    pub async fn get_sample(
        &self,
        bucket: &str,
        key: &str,
        range: Option<std::ops::Range<u64>>,
    ) -> Result<Bytes, SourceError> {
        let header = range_header(range.as_ref());
        Ok(self
            .get_with(bucket, key, header, Some(self.max_object_bytes))
            .await?
            .0)
    }

    /// GETs `range` of an object (the whole object for `None`), retrying transient failures.
    /// The answer is shorter than asked when the object ends inside the range; a range that
    /// starts past the end is [`SourceError::RangeNotSatisfiable`].
    pub async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Option<std::ops::Range<u64>>,
    ) -> Result<Bytes, SourceError> {
        Ok(self
            .get_with(bucket, key, range_header(range.as_ref()), None)
            .await?
            .0)
    }

    /// GETs the last `len` bytes of an object (all of it when shorter), with the object's
    /// size: how a Parquet footer is read without knowing the file's length first.
    pub async fn get_tail(
        &self,
        bucket: &str,
        key: &str,
        len: u64,
    ) -> Result<(Bytes, u64), SourceError> {
        let (bytes, content_range) = self
            .get_with(bucket, key, Some(format!("bytes=-{}", len.max(1))), None)
            .await?;
        // `bytes 100-199/200`; a server that ignores the range sends the whole object.
        let size = content_range
            .and_then(|r| r.rsplit_once('/')?.1.parse().ok())
            .unwrap_or(bytes.len() as u64);
        Ok((bytes, size))
    }

    /// One GET with an optional `Range` header, retried; the body and the `Content-Range`.
    /// With `limit`, an answer announcing more bytes is refused unread.
    async fn get_with(
        &self,
        bucket: &str,
        key: &str,
        header: Option<String>,
        limit: Option<u64>,
    ) -> Result<(Bytes, Option<String>), SourceError> {
        let attempt = |_| async {
            // The permit bounds concurrent GETs; it is released during backoff.
            let _permit = self.gets.acquire().await;
            let t0 = Instant::now();
            self.metrics.s3_request("get_object");
            let sent = self
                .client
                .get_object()
                .bucket(bucket)
                .key(key)
                .set_range(header.clone())
                .send()
                .await;
            let failed = match sent {
                Ok(out) => match over(out.content_length, limit) {
                    // Refused from the headers: the body is dropped unread.
                    Some((bytes, limit)) => Attempt::TooLarge { bytes, limit },
                    None => match out.body.collect().await {
                        Ok(data) => {
                            let bytes = data.into_bytes();
                            self.metrics.observe_get(t0.elapsed(), bytes.len());
                            return Outcome::Done((bytes, out.content_range));
                        }
                        Err(e) => Attempt::Retry {
                            status: 0,
                            detail: format!("reading body: {e}"),
                        },
                    },
                },
                Err(e) => classify(&e),
            };
            self.count_throttle(&failed);
            failed.retried()
        };
        self.retry
            .run(attempt, |_| self.metrics.s3_retry())
            .await
            .map_err(|gave_up| self.get_failed(bucket, key, header.as_deref(), gave_up))
    }

    fn count_throttle(&self, failed: &Attempt) {
        if matches!(failed, Attempt::Throttled) {
            self.metrics.s3_throttle();
        }
    }

    /// The error of a GET that gave up, counted by its category.
    fn get_failed(
        &self,
        bucket: &str,
        key: &str,
        range: Option<&str>,
        gave_up: GaveUp<Attempt>,
    ) -> SourceError {
        let (bucket, key, attempts) = (bucket.to_string(), key.to_string(), gave_up.attempts);
        let (category, error) = match gave_up.error {
            Attempt::NotFound => return SourceError::NotFound { bucket, key },
            Attempt::RangeNotSatisfiable => {
                let range = range.unwrap_or_default().to_string();
                return SourceError::RangeNotSatisfiable { bucket, key, range };
            }
            Attempt::TooLarge { bytes, limit } => (
                "too_large",
                SourceError::TooLarge {
                    bucket,
                    key,
                    bytes,
                    limit,
                },
            ),
            Attempt::AccessDenied(status) => (
                "access_denied",
                SourceError::AccessDenied {
                    bucket,
                    key,
                    status,
                },
            ),
            Attempt::Fatal(detail) => (
                "request",
                SourceError::Request {
                    bucket,
                    key,
                    detail,
                },
            ),
            Attempt::Throttled => (
                "throttled",
                SourceError::Throttled {
                    bucket,
                    key,
                    attempts,
                },
            ),
            Attempt::Retry { status, .. } if status > 0 => (
                "server_error",
                SourceError::Server {
                    bucket,
                    key,
                    status,
                    attempts,
                },
            ),
            Attempt::Retry { detail, .. } => (
                "transport",
                SourceError::Transport {
                    bucket,
                    key,
                    attempts,
                    detail,
                },
            ),
        };
        self.metrics.s3_error(category);
        error
    }

    /// Lists every key under `prefix` (ListObjectsV2, `page_size` keys per page), retrying
    /// each page like a GET. Keys ending in `/` (folder markers) are left out.
    pub async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        page_size: i32,
    ) -> Result<Vec<SampleRef>, SourceError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let attempt = |_| async {
                self.metrics.s3_request("list_objects_v2");
                let sent = self
                    .client
                    .list_objects_v2()
                    .bucket(bucket)
                    .prefix(prefix)
                    .max_keys(page_size)
                    .set_continuation_token(token.clone())
                    .send()
                    .await;
                match sent {
                    Ok(page) => Outcome::Done(page),
                    Err(e) => {
                        let failed = classify(&e);
                        self.count_throttle(&failed);
                        failed.retried()
                    }
                }
            };
            let page = self
                .retry
                .run(attempt, |_| self.metrics.s3_retry())
                .await
                .map_err(|gave_up| {
                    let fatal = |detail: String| SourceError::Request {
                        bucket: bucket.into(),
                        key: prefix.into(),
                        detail,
                    };
                    match gave_up.error {
                        _ if gave_up.exhausted => fatal(format!(
                            "listing failed after {} attempts",
                            gave_up.attempts
                        )),
                        Attempt::AccessDenied(status) => SourceError::AccessDenied {
                            bucket: bucket.into(),
                            key: prefix.into(),
                            status,
                        },
                        Attempt::Fatal(detail) => fatal(detail),
                        _ => fatal("bucket not found".into()),
                    }
                })?;
            for obj in page.contents() {
                if let Some(k) = obj.key()
                    && !k.ends_with('/')
                {
                    out.push(SampleRef {
                        key: k.to_string(),
                        metadata: String::new(),
                        ..SampleRef::default()
                    });
                }
            }
            token = page.next_continuation_token().map(str::to_string);
            if token.is_none() || page.is_truncated() != Some(true) {
                break;
            }
        }
        Ok(out)
    }

    /// PUTs one object (the dataset index), retrying transient failures.
    pub async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<(), SourceError> {
        let attempt = |_| async {
            self.metrics.s3_request("put_object");
            let sent = self
                .client
                .put_object()
                .bucket(bucket)
                .key(key)
                .body(body.clone().into())
                .send()
                .await;
            let failed = match sent {
                Ok(_) => return Outcome::Done(()),
                Err(e) => classify(&e),
            };
            self.count_throttle(&failed);
            match failed {
                // Unlike a GET's, a PUT's 404 or 416 is tried again.
                Attempt::AccessDenied(_) | Attempt::Fatal(_) => Outcome::Final(failed),
                _ => Outcome::Retry(failed),
            }
        };
        let gave_up = match self.retry.run(attempt, |_| self.metrics.s3_retry()).await {
            Ok(()) => return Ok(()),
            Err(gave_up) => gave_up,
        };
        let (bucket, key) = (bucket.to_string(), key.to_string());
        Err(match gave_up.error {
            Attempt::AccessDenied(status) => SourceError::AccessDenied {
                bucket,
                key,
                status,
            },
            Attempt::Fatal(detail) => SourceError::Request {
                bucket,
                key,
                detail,
            },
            _ => SourceError::Request {
                bucket,
                key,
                detail: format!("PUT failed after {} attempts", gave_up.attempts),
            },
        })
    }

    /// Reads a JSONL manifest from S3 or the local disk.
    pub async fn load_manifest(
        &self,
        location: &ManifestLocation,
    ) -> Result<Vec<SampleRef>, SourceError> {
        let name = location.to_string();
        let text = match location {
            ManifestLocation::S3 { bucket, key } => {
                let bytes = self.get(bucket, key).await?;
                String::from_utf8(bytes.to_vec()).map_err(|e| SourceError::ManifestRead {
                    location: name.clone(),
                    detail: e.to_string(),
                })?
            }
            ManifestLocation::File(path) => {
                tokio::fs::read_to_string(path)
                    .await
                    .map_err(|e| SourceError::ManifestRead {
                        location: name.clone(),
                        detail: e.to_string(),
                    })?
            }
        };
        parse_manifest(&name, &text)
    }
}
