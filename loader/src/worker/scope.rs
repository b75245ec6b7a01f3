//! What a decoder may read: its pipeline's bucket, and keys under its prefix. A decoder holds
//! the pipeline's S3 credentials; without this check anyone reaching its port could have it
//! read any object those credentials can (a confused deputy).
//!
//! The rule: the request's bucket must be the pipeline's (`--bucket`); with `--prefix`, every
//! key fetched from S3 must start with it and have no `.` or `..` segment (some S3-compatible
//! stores resolve them). Manifest pipelines get no `--prefix`: their keys may lie anywhere in
//! the bucket, and the sidecar fetches them from the pipeline's bucket, never the manifest's.

use crate::proto;

/// A pipeline's source, as the decoder was started with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceScope {
    pub bucket: String,
    /// Empty: the whole bucket.
    pub prefix: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScopeViolation {
    #[error("bucket {requested:?} is not this pipeline's bucket")]
    Bucket { requested: String },
    #[error("key {key:?} is outside this pipeline's prefix {prefix:?}")]
    Key { key: String, prefix: String },
}

impl ScopeViolation {
    /// The reason on `stoker_loader_rejected_batches_total`.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Bucket { .. } => "bucket_outside_pipeline",
            Self::Key { .. } => "key_outside_prefix",
        }
    }
}

/// Longest key quoted in a refusal or a log line.
const QUOTED_KEY_CHARS: usize = 200;

fn quoted(key: &str) -> String {
    key.chars().take(QUOTED_KEY_CHARS).collect()
}

impl SourceScope {
    /// The first sample of `request` the pipeline may not read, if any. Inline samples are not
    /// fetched and so not checked; the bucket is, whatever the samples.
    pub fn check(&self, request: &proto::DecodeBatchRequest) -> Result<(), ScopeViolation> {
        if request.bucket != self.bucket {
            return Err(ScopeViolation::Bucket {
                requested: quoted(&request.bucket),
            });
        }
        if self.prefix.is_empty() {
            return Ok(());
        }
        let outside = request
            .samples
            .iter()
            .filter(|s| s.inline.is_empty())
            .find(|s| !self.holds(&s.key));
        match outside {
            Some(s) => Err(ScopeViolation::Key {
                key: quoted(&s.key),
                prefix: self.prefix.clone(),
            }),
            None => Ok(()),
        }
    }

    fn holds(&self, key: &str) -> bool {
        key.starts_with(&self.prefix) && !key.split('/').any(|seg| seg == ".." || seg == ".")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(bucket: &str, keys: &[&str]) -> proto::DecodeBatchRequest {
        proto::DecodeBatchRequest {
            bucket: bucket.into(),
            samples: keys
                .iter()
                .map(|k| proto::SampleRef {
                    key: (*k).into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn scope(prefix: &str) -> SourceScope {
        SourceScope {
            bucket: "laion".into(),
            prefix: prefix.into(),
        }
    }

    #[test]
    fn only_the_pipelines_bucket_and_prefix_are_read() {
        let s = scope("images/");
        assert_eq!(
            s.check(&request("laion", &["images/a.jpg", "images/b/c.jpg"])),
            Ok(())
        );
        let other = s.check(&request("secrets", &["images/a.jpg"])).unwrap_err();
        assert_eq!(other.category(), "bucket_outside_pipeline");
        for key in [
            "labels/a.json",
            "image",
            "images/../labels/a.json",
            "images/./a.jpg",
        ] {
            let refused = s
                .check(&request("laion", &["images/a.jpg", key]))
                .unwrap_err();
            assert_eq!(refused.category(), "key_outside_prefix", "{key}");
        }
    }

    #[test]
    fn without_a_prefix_the_whole_bucket_is_open() {
        let s = scope("");
        assert_eq!(
            s.check(&request("laion", &["anywhere/a.jpg", "../x"])),
            Ok(())
        );
        assert!(s.check(&request("other", &[])).is_err());
    }

    #[test]
    fn inline_samples_are_not_fetched_and_not_checked() {
        let mut r = request("laion", &["elsewhere/a.png"]);
        r.samples[0].inline = vec![1, 2, 3].into();
        assert_eq!(scope("images/").check(&r), Ok(()));
    }

    #[test]
    fn a_refusal_quotes_a_bounded_key() {
        let long = format!("x{}", "y".repeat(10_000));
        let Err(ScopeViolation::Key { key, .. }) =
            scope("images/").check(&request("laion", &[&long]))
        else {
            panic!("not refused");
        };
        assert_eq!(key.chars().count(), QUOTED_KEY_CHARS);
    }
}
