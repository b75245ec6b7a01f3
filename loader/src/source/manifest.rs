//! JSONL manifests: one sample per line, either a JSON object with a `key` (the other fields
//! are carried through as metadata) or a bare object key.

use super::{SampleRef, SourceError};

/// Where a manifest lives: `s3://bucket/key` or a local path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestLocation {
    S3 { bucket: String, key: String },
    File(std::path::PathBuf),
}

impl ManifestLocation {
    pub fn parse(s: &str) -> ManifestLocation {
        if let Some(rest) = s.strip_prefix("s3://") {
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            ManifestLocation::S3 {
                bucket: bucket.to_string(),
                key: key.to_string(),
            }
        } else {
            ManifestLocation::File(s.into())
        }
    }
}

impl std::fmt::Display for ManifestLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ManifestLocation::S3 { bucket, key } => write!(f, "s3://{bucket}/{key}"),
            ManifestLocation::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Fields accepted as the object key, in order of preference.
const KEY_FIELDS: [&str; 3] = ["key", "image", "path"];

pub fn parse_manifest(location: &str, text: &str) -> Result<Vec<SampleRef>, SourceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if !line.starts_with('{') {
            out.push(SampleRef {
                key: line.to_string(),
                metadata: String::new(),
                ..SampleRef::default()
            });
            continue;
        }
        let err = |detail: String| SourceError::Manifest {
            location: location.to_string(),
            line: i + 1,
            detail,
        };
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        let key = KEY_FIELDS
            .iter()
            .find_map(|f| match obj.remove(*f) {
                Some(serde_json::Value::String(s)) => Some(s),
                _ => None,
            })
            .ok_or_else(|| err("no string field \"key\"".into()))?;
        let metadata = if obj.is_empty() {
            String::new()
        } else {
            serde_json::Value::Object(obj).to_string()
        };
        out.push(SampleRef {
            key,
            metadata,
            ..SampleRef::default()
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_objects_and_bare_keys() {
        let text = "{\"key\":\"a.jpg\",\"caption\":\"a cat\",\"label\":3}\n\nb.png\n{\"image\":\"c.webp\"}\n";
        let s = parse_manifest("m.jsonl", text).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].key, "a.jpg");
        let meta: serde_json::Value = serde_json::from_str(&s[0].metadata).unwrap();
        assert_eq!(meta["caption"], "a cat");
        assert_eq!(meta["label"], 3);
        assert_eq!(
            s[1],
            SampleRef {
                key: "b.png".into(),
                metadata: String::new(),
                ..SampleRef::default()
            }
        );
        assert_eq!(s[2].key, "c.webp");
        let bad = parse_manifest("m.jsonl", "{\"caption\":\"x\"}").unwrap_err();
        assert!(bad.to_string().contains("line 1"));
    }

    #[test]
    fn parses_locations() {
        assert_eq!(
            ManifestLocation::parse("s3://b/dir/train.jsonl"),
            ManifestLocation::S3 {
                bucket: "b".into(),
                key: "dir/train.jsonl".into()
            }
        );
        assert_eq!(
            ManifestLocation::parse("/tmp/m.jsonl"),
            ManifestLocation::File("/tmp/m.jsonl".into())
        );
    }
}
