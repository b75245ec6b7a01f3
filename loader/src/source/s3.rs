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

/// Full-jitter exponential backoff: attempt n sleeps uniformly in [0, min(cap, base·2ⁿ)].
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            base: Duration::from_millis(25),
            cap: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    pub fn backoff(&self, attempt: u32) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.cap);
        ceiling.mul_f64(fastrand::f64())
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

/// A connected S3 client with its GET limiter. Cheap to clone.
#[derive(Clone)]
pub struct S3Source {
    client: aws_sdk_s3::Client,
    gets: Arc<Semaphore>,
    retry: RetryPolicy,
    metrics: Arc<LoaderMetrics>,
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
        }
    }

    pub fn client(&self) -> &aws_sdk_s3::Client {
        &self.client
    }

    /// GETs one object whole, retrying transient failures. 404 is final.
    pub async fn get(&self, bucket: &str, key: &str) -> Result<Bytes, SourceError> {
        self.get_range(bucket, key, None).await
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
        let header = range
            .as_ref()
            .map(|r| format!("bytes={}-{}", r.start, r.end.max(r.start + 1) - 1));
        Ok(self.get_with(bucket, key, header).await?.0)
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
            .get_with(bucket, key, Some(format!("bytes=-{}", len.max(1))))
            .await?;
        // `bytes 100-199/200`; a server that ignores the range sends the whole object.
        let size = content_range
            .and_then(|r| r.rsplit_once('/')?.1.parse().ok())
            .unwrap_or(bytes.len() as u64);
        Ok((bytes, size))
    }

    /// One GET with an optional `Range` header, retried; the body and the `Content-Range`.
    async fn get_with(
        &self,
        bucket: &str,
        key: &str,
        header: Option<String>,
    ) -> Result<(Bytes, Option<String>), SourceError> {
        let mut attempt = 0u32;
        loop {
            let outcome = {
                // The permit bounds concurrent GETs; it is released during backoff.
                let _permit = self.gets.acquire().await;
                let t0 = Instant::now();
                self.metrics.s3_request("get_object");
                let result = match self
                    .client
                    .get_object()
                    .bucket(bucket)
                    .key(key)
                    .set_range(header.clone())
                    .send()
                    .await
                {
                    Ok(out) => match out.body.collect().await {
                        Ok(data) => Ok((data.into_bytes(), out.content_range)),
                        Err(e) => Err(Attempt::Retry {
                            status: 0,
                            detail: format!("reading body: {e}"),
                        }),
                    },
                    Err(e) => Err(classify(&e)),
                };
                if let Ok((b, _)) = &result {
                    self.metrics.observe_get(t0.elapsed(), b.len());
                }
                result
            };
            let err = match outcome {
                Ok(b) => return Ok(b),
                Err(e) => e,
            };
            attempt += 1;
            let exhausted = attempt >= self.retry.max_attempts;
            match err {
                Attempt::NotFound => {
                    return Err(SourceError::NotFound {
                        bucket: bucket.into(),
                        key: key.into(),
                    });
                }
                Attempt::RangeNotSatisfiable => {
                    return Err(SourceError::RangeNotSatisfiable {
                        bucket: bucket.into(),
                        key: key.into(),
                        range: header.unwrap_or_default(),
                    });
                }
                Attempt::AccessDenied(status) => {
                    self.metrics.s3_error("access_denied");
                    return Err(SourceError::AccessDenied {
                        bucket: bucket.into(),
                        key: key.into(),
                        status,
                    });
                }
                Attempt::Fatal(detail) => {
                    self.metrics.s3_error("request");
                    return Err(SourceError::Request {
                        bucket: bucket.into(),
                        key: key.into(),
                        detail,
                    });
                }
                Attempt::Throttled => {
                    self.metrics.s3_throttle();
                    if exhausted {
                        self.metrics.s3_error("throttled");
                        return Err(SourceError::Throttled {
                            bucket: bucket.into(),
                            key: key.into(),
                            attempts: attempt,
                        });
                    }
                }
                Attempt::Retry { status, detail } => {
                    if exhausted {
                        if status > 0 {
                            self.metrics.s3_error("server_error");
                            return Err(SourceError::Server {
                                bucket: bucket.into(),
                                key: key.into(),
                                status,
                                attempts: attempt,
                            });
                        }
                        self.metrics.s3_error("transport");
                        return Err(SourceError::Transport {
                            bucket: bucket.into(),
                            key: key.into(),
                            attempts: attempt,
                            detail,
                        });
                    }
                }
            }
            self.metrics.s3_retry();
            tokio::time::sleep(self.retry.backoff(attempt)).await;
        }
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
            let mut attempt = 0u32;
            let page = loop {
                self.metrics.s3_request("list_objects_v2");
                let res = self
                    .client
                    .list_objects_v2()
                    .bucket(bucket)
                    .prefix(prefix)
                    .max_keys(page_size)
                    .set_continuation_token(token.clone())
                    .send()
                    .await;
                let err = match res {
                    Ok(page) => break page,
                    Err(e) => classify(&e),
                };
                attempt += 1;
                let fatal = |detail: String| SourceError::Request {
                    bucket: bucket.into(),
                    key: prefix.into(),
                    detail,
                };
                match err {
                    Attempt::NotFound | Attempt::RangeNotSatisfiable => {
                        return Err(fatal("bucket not found".into()));
                    }
                    Attempt::AccessDenied(status) => {
                        return Err(SourceError::AccessDenied {
                            bucket: bucket.into(),
                            key: prefix.into(),
                            status,
                        });
                    }
                    Attempt::Fatal(d) => return Err(fatal(d)),
                    Attempt::Throttled => self.metrics.s3_throttle(),
                    Attempt::Retry { .. } => {}
                }
                if attempt >= self.retry.max_attempts {
                    return Err(fatal(format!("listing failed after {attempt} attempts")));
                }
                self.metrics.s3_retry();
                tokio::time::sleep(self.retry.backoff(attempt)).await;
            };
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
        let mut attempt = 0u32;
        loop {
            self.metrics.s3_request("put_object");
            let res = self
                .client
                .put_object()
                .bucket(bucket)
                .key(key)
                .body(body.clone().into())
                .send()
                .await;
            let err = match res {
                Ok(_) => return Ok(()),
                Err(e) => classify(&e),
            };
            attempt += 1;
            match err {
                Attempt::AccessDenied(status) => {
                    return Err(SourceError::AccessDenied {
                        bucket: bucket.into(),
                        key: key.into(),
                        status,
                    });
                }
                Attempt::Fatal(detail) => {
                    return Err(SourceError::Request {
                        bucket: bucket.into(),
                        key: key.into(),
                        detail,
                    });
                }
                Attempt::Throttled => self.metrics.s3_throttle(),
                _ => {}
            }
            if attempt >= self.retry.max_attempts {
                return Err(SourceError::Request {
                    bucket: bucket.into(),
                    key: key.into(),
                    detail: format!("PUT failed after {attempt} attempts"),
                });
            }
            self.metrics.s3_retry();
            tokio::time::sleep(self.retry.backoff(attempt)).await;
        }
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
