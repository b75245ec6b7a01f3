//! The dataset index, built once per pipeline by `stoker-loader index` and read by sidecars
//! instead of listing the dataset.
//!
//! Two objects under one location (`s3://bucket/prefix/` or a directory), the summary and the
//! per-shard tables of the dataset's kind:
//! - `index.json`, the summary: per shard its key, sample count and size (O(shards); about
//!   60 bytes per shard as JSON, so 4,096 shards are ~250 KB) and the samples the build could
//!   not index, each with its shard and reason. This is all a sidecar loads at start.
//! - `offsets.bin` (WebDataset): per shard, where each sample starts and where the last one
//!   ends, as little-endian u64 (8 bytes per sample + 8 per shard). A sidecar range-reads one
//!   shard's table when the shuffle window reaches that shard and drops it after.
//! - `parquet.jsonl` (Parquet): per file one JSON line ([`parquet::FileTable`]): the image
//!   column's pages (about 55 bytes each) and each row's metadata columns as a JSON string
//!   (about 70 bytes for a short caption and a label); the summary gives each line's byte range.
//!
//! Where it lives: a location the user names, separate from the data, so the data's
//! credentials stay read-only (only the index Job needs write access there). The summary fits
//! a ConfigMap for small datasets, but 10 M samples of offsets (80 MB) do not, and an object
//! store is what every decoder and sidecar can already read.

use std::ops::Range;

use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

pub mod parquet;

use crate::source::tar::{SampleBounds, TarWalker};
use crate::source::{ManifestLocation, S3Source, SampleRef, SourceError};

/// A sample of a sharded dataset (WebDataset tar shards): the shard's number in the index and
/// the sample's number inside it. 8 bytes; the plan never holds one per sample of the dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardSample {
    pub shard: u32,
    pub index: u32,
}

pub const INDEX_VERSION: u32 = 1;
pub const SUMMARY_NAME: &str = "index.json";
pub const OFFSETS_NAME: &str = "offsets.bin";
pub const PARQUET_TABLES_NAME: &str = "parquet.jsonl";

/// Bytes one range GET reads while indexing a shard: large enough that the request cost is
/// small against the transfer, small enough to retry cheaply.
pub const INDEX_READ_BYTES: u64 = 8 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("shard pattern {pattern:?}: {detail}")]
    Pattern { pattern: String, detail: String },
    #[error("no {what} files match {pattern:?}")]
    NoShards { pattern: String, what: &'static str },
    #[error("index at {location}: {detail}")]
    Format { location: String, detail: String },
    #[error("index at {location}: {source}")]
    Io {
        location: String,
        #[source]
        source: std::io::Error,
    },
}

impl IndexError {
    pub fn category(&self) -> &'static str {
        match self {
            IndexError::Source(e) => e.category(),
            IndexError::Pattern { .. } => "pattern",
            IndexError::NoShards { .. } => "no_shards",
            IndexError::Format { .. } => "format",
            IndexError::Io { .. } => "io",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub key: String,
    pub samples: u32,
    /// Bytes of the shard: read while indexing (WebDataset), the file's size (Parquet).
    pub bytes: u64,
    /// Parquet: where the file's table lies in `parquet.jsonl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<[u64; 2]>,
}

/// What the shards are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexKind {
    /// `.tar` shards; each sample's members back to back (`offsets.bin`).
    #[default]
    WebDataset,
    /// Parquet files; a sample is a row (`parquet.jsonl`).
    Parquet,
}

/// A sample the build left out, with its shard and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexProblem {
    pub key: String,
    pub offset: u64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetIndex {
    pub version: u32,
    #[serde(default)]
    pub kind: IndexKind,
    pub bucket: String,
    pub shards: Vec<ShardEntry>,
    pub samples: u64,
    pub problems: Vec<IndexProblem>,
}

/// Expands one or more numeric brace ranges (`laion/{00000..04095}.tar`), keeping the lower
/// bound's zero padding, as WebDataset and img2dataset write them.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>, IndexError> {
    let bad = |detail: &str| IndexError::Pattern {
        pattern: pattern.into(),
        detail: detail.into(),
    };
    let Some(open) = pattern.find('{') else {
        return Ok(vec![pattern.to_string()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| open + c)
        .ok_or_else(|| bad("'{' without '}'"))?;
    let (lo, hi) = pattern[open + 1..close]
        .split_once("..")
        .ok_or_else(|| bad("braces must hold a range such as {00000..04095}"))?;
    let width = lo.len();
    let lo: u64 = lo
        .parse()
        .map_err(|_| bad("range bounds must be numbers"))?;
    let hi: u64 = hi
        .parse()
        .map_err(|_| bad("range bounds must be numbers"))?;
    if hi < lo || hi - lo >= 10_000_000 {
        return Err(bad("the range is empty or larger than 10,000,000 shards"));
    }
    let mut out = Vec::new();
    for rest in expand_braces(&pattern[close + 1..])? {
        out.reserve((hi - lo + 1) as usize);
        for n in lo..=hi {
            out.push(format!("{}{n:0width$}{rest}", &pattern[..open]));
        }
    }
    out.sort();
    Ok(out)
}

/// The shards a source names: `s3://bucket/pattern{..}.tar`, or `s3://bucket/prefix/` for
/// every file under the prefix ending in `ext` (`.tar`, `.parquet`). Returns the bucket and
/// the keys.
pub async fn resolve_shards(
    source: &S3Source,
    url: &str,
    ext: &'static str,
) -> Result<(String, Vec<String>), IndexError> {
    let ManifestLocation::S3 { bucket, key } = ManifestLocation::parse(url) else {
        return Err(IndexError::Pattern {
            pattern: url.into(),
            detail: "shards must be an s3:// URL".into(),
        });
    };
    let keys = if key.contains('{') {
        expand_braces(&key)?
    } else {
        let mut keys: Vec<String> = source
            .list(&bucket, &key, 1000)
            .await?
            .into_iter()
            .map(|s| s.key)
            .filter(|k| k.ends_with(ext))
            .collect();
        keys.sort();
        keys
    };
    if keys.is_empty() {
        return Err(IndexError::NoShards {
            pattern: url.into(),
            what: ext,
        });
    }
    Ok((bucket, keys))
}

/// One shard indexed: its sample starts (plus the end) and what was left out.
struct IndexedShard {
    entry: ShardEntry,
    starts: Vec<u64>,
    problems: Vec<IndexProblem>,
}

/// Reads one shard once, in [`INDEX_READ_BYTES`] range GETs, walking its headers.
async fn index_shard(
    source: &S3Source,
    bucket: &str,
    key: &str,
) -> Result<IndexedShard, IndexError> {
    let mut walker = TarWalker::new();
    let mut bounds = SampleBounds::default();
    let mut problems = Vec::new();
    let mut read = 0u64;
    loop {
        let range = read..read + INDEX_READ_BYTES;
        let chunk = match source.get_range(bucket, key, Some(range)).await {
            Ok(c) => c,
            Err(SourceError::RangeNotSatisfiable { .. }) => Bytes::new(),
            Err(e) => return Err(e.into()),
        };
        read += chunk.len() as u64;
        match walker.feed(&chunk) {
            Ok(members) => members.iter().for_each(|m| bounds.push(m)),
            Err(e) => {
                problems.push(IndexProblem {
                    key: key.into(),
                    offset: walker.position(),
                    reason: e.to_string(),
                });
                break;
            }
        }
        if walker.finished() || (chunk.len() as u64) < INDEX_READ_BYTES {
            break;
        }
    }
    let counted = bounds.samples();
    let starts = bounds.finish(read);
    let samples = starts.len().saturating_sub(1);
    if !walker.finished() && problems.is_empty() {
        let at = starts.last().copied().unwrap_or(0);
        problems.push(IndexProblem {
            key: key.into(),
            offset: at,
            reason: format!(
                "shard ends at byte {read} without the end-of-archive blocks (truncated); {} sample(s) from byte {at} left out",
                counted - samples
            ),
        });
    }
    Ok(IndexedShard {
        entry: ShardEntry {
            key: key.into(),
            samples: samples as u32,
            bytes: read,
            table: None,
        },
        starts,
        problems,
    })
}

/// Builds the index of WebDataset shards: every shard read once, `parallel` at a time.
/// Returns the summary and `offsets.bin`.
pub async fn build_webdataset(
    source: &S3Source,
    bucket: &str,
    keys: &[String],
    parallel: usize,
) -> Result<(DatasetIndex, Vec<u8>), IndexError> {
    let mut shards = futures::stream::iter(keys.iter())
        .map(|k| index_shard(source, bucket, k))
        .buffered(parallel.max(1));
    let mut index = DatasetIndex {
        version: INDEX_VERSION,
        kind: IndexKind::WebDataset,
        bucket: bucket.into(),
        shards: Vec::with_capacity(keys.len()),
        samples: 0,
        problems: Vec::new(),
    };
    let mut offsets = Vec::new();
    while let Some(shard) = shards.next().await {
        let shard = shard?;
        index.samples += u64::from(shard.entry.samples);
        // A shard without samples still has its one-entry table, so tables are findable.
        if shard.starts.is_empty() {
            offsets.extend_from_slice(&0u64.to_le_bytes());
        }
        for s in &shard.starts {
            offsets.extend_from_slice(&s.to_le_bytes());
        }
        index.shards.push(shard.entry);
        index.problems.extend(shard.problems);
    }
    Ok((index, offsets))
}

/// Builds the index of Parquet files: every footer read, the image pages walked and the
/// metadata columns read, `parallel` files at a time. Returns the summary and `parquet.jsonl`.
pub async fn build_parquet(
    source: &S3Source,
    bucket: &str,
    keys: &[String],
    columns: &parquet::ParquetColumns,
    parallel: usize,
) -> Result<(DatasetIndex, Vec<u8>), IndexError> {
    let mut files = futures::stream::iter(keys.iter())
        .map(|k| parquet::index_file(source, bucket, k, columns))
        .buffered(parallel.max(1));
    let mut index = DatasetIndex {
        version: INDEX_VERSION,
        kind: IndexKind::Parquet,
        bucket: bucket.into(),
        shards: Vec::with_capacity(keys.len()),
        samples: 0,
        problems: Vec::new(),
    };
    let mut tables = Vec::new();
    while let Some(file) = files.next().await {
        let mut file = file?;
        let at = tables.len() as u64;
        serde_json::to_writer(&mut tables, &file.table).map_err(|e| IndexError::Format {
            location: file.entry.key.clone(),
            detail: e.to_string(),
        })?;
        tables.push(b'\n');
        file.entry.table = Some([at, tables.len() as u64]);
        index.samples += u64::from(file.entry.samples);
        index.shards.push(file.entry);
        index.problems.extend(file.problems);
    }
    Ok((index, tables))
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() || prefix.ends_with('/') {
        format!("{prefix}{name}")
    } else {
        format!("{prefix}/{name}")
    }
}

/// Writes the summary and the offsets under `location`.
pub async fn write_index(
    source: &S3Source,
    location: &ManifestLocation,
    index: &DatasetIndex,
    offsets: Vec<u8>,
) -> Result<(), IndexError> {
    let summary = serde_json::to_vec(index).map_err(|e| IndexError::Format {
        location: location.to_string(),
        detail: e.to_string(),
    })?;
    let tables_name = index.kind.tables_name();
    match location {
        ManifestLocation::S3 { bucket, key } => {
            source
                .put(bucket, &join(key, tables_name), offsets.into())
                .await?;
            source
                .put(bucket, &join(key, SUMMARY_NAME), summary.into())
                .await?;
        }
        ManifestLocation::File(dir) => {
            let io = |source| IndexError::Io {
                location: location.to_string(),
                source,
            };
            tokio::fs::create_dir_all(dir).await.map_err(io)?;
            tokio::fs::write(dir.join(tables_name), offsets)
                .await
                .map_err(io)?;
            tokio::fs::write(dir.join(SUMMARY_NAME), summary)
                .await
                .map_err(io)?;
        }
    }
    Ok(())
}

impl IndexKind {
    /// The file holding the per-shard tables.
    pub fn tables_name(self) -> &'static str {
        match self {
            IndexKind::WebDataset => OFFSETS_NAME,
            IndexKind::Parquet => PARQUET_TABLES_NAME,
        }
    }
}

/// What a sidecar holds of the index: the summary's shard table (O(shards)) and where to
/// range-read each shard's own table.
#[derive(Debug, Clone)]
pub struct ShardTable {
    pub location: ManifestLocation,
    pub kind: IndexKind,
    pub bucket: String,
    pub keys: Vec<String>,
    /// Samples per shard: what the plan shuffles over.
    pub counts: Vec<u32>,
    /// Where each shard's table lies in the tables file (`offsets.bin`, `parquet.jsonl`).
    tables: Vec<[u64; 2]>,
}

/// One shard's table, read when a batch needs it.
enum LoadedShard {
    /// Where each sample starts, and where the last one ends.
    Offsets(Vec<u64>),
    Parquet(parquet::FileTable),
}

impl ShardTable {
    pub async fn load(source: &S3Source, location: ManifestLocation) -> Result<Self, IndexError> {
        let bytes = read(source, &location, SUMMARY_NAME, None).await?;
        let index: DatasetIndex =
            serde_json::from_slice(&bytes).map_err(|e| IndexError::Format {
                location: location.to_string(),
                detail: e.to_string(),
            })?;
        if index.version != INDEX_VERSION {
            return Err(IndexError::Format {
                location: location.to_string(),
                detail: format!(
                    "index version {} (this loader reads {INDEX_VERSION}): run `stoker-loader index` again",
                    index.version
                ),
            });
        }
        let mut tables = Vec::with_capacity(index.shards.len());
        let mut at = 0u64;
        for s in &index.shards {
            let table = match (index.kind, s.table) {
                (IndexKind::WebDataset, _) => [at, at + 8 * (u64::from(s.samples) + 1)],
                (IndexKind::Parquet, Some(t)) => t,
                (IndexKind::Parquet, None) => {
                    return Err(IndexError::Format {
                        location: location.to_string(),
                        detail: format!("file {} has no table", s.key),
                    });
                }
            };
            at = table[1];
            tables.push(table);
        }
        Ok(ShardTable {
            location,
            kind: index.kind,
            bucket: index.bucket,
            keys: index.shards.iter().map(|s| s.key.clone()).collect(),
            counts: index.shards.iter().map(|s| s.samples).collect(),
            tables,
        })
    }

    /// Resident bytes of this table (what the plan costs per shard besides the order).
    pub fn resident_bytes(&self) -> usize {
        self.keys.iter().map(|k| k.capacity() + 24).sum::<usize>()
            + self.counts.capacity() * 4
            + self.tables.capacity() * 16
    }

    /// Shard `shard`'s own table: one range read of the tables file.
    async fn load_shard(&self, source: &S3Source, shard: u32) -> Result<LoadedShard, IndexError> {
        let s = shard as usize;
        let bad = |detail: String| IndexError::Format {
            location: self.location.to_string(),
            detail: format!("table of shard {}: {detail}", self.keys[s]),
        };
        let [at, end] = self.tables[s];
        if end < at {
            return Err(bad(format!("its bytes {at}..{end} run backwards")));
        }
        let bytes = read(
            source,
            &self.location,
            self.kind.tables_name(),
            Some(at..end),
        )
        .await?;
        if bytes.len() as u64 != end - at {
            return Err(bad("cut short".into()));
        }
        Ok(match self.kind {
            IndexKind::WebDataset => LoadedShard::Offsets(offsets_table(&bytes).map_err(bad)?),
            IndexKind::Parquet => LoadedShard::Parquet(
                serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?,
            ),
        })
    }

    /// The decode requests' samples for planned shard samples, reading each shard's table
    /// once per call.
    pub async fn sample_refs(
        &self,
        source: &S3Source,
        samples: &[ShardSample],
    ) -> Result<Vec<SampleRef>, IndexError> {
        let mut tables: std::collections::HashMap<u32, LoadedShard> = Default::default();
        for s in samples {
            if let std::collections::hash_map::Entry::Vacant(e) = tables.entry(s.shard) {
                e.insert(self.load_shard(source, s.shard).await?);
            }
        }
        samples
            .iter()
            .map(|s| {
                let key = &self.keys[s.shard as usize];
                let i = s.index as usize;
                let found = match &tables[&s.shard] {
                    LoadedShard::Offsets(t) => t.get(i..i + 2).map(|w| SampleRef {
                        key: key.clone(),
                        range: Some(w[0]..w[1]),
                        ..SampleRef::default()
                    }),
                    LoadedShard::Parquet(t) => t.sample_ref(key, s.index),
                };
                found.ok_or_else(|| IndexError::Format {
                    location: self.location.to_string(),
                    detail: format!("shard {key} has no sample {i}"),
                })
            })
            .collect()
    }
}

/// A shard's sample starts (and the last sample's end), as `offsets.bin` stores them: little-
/// endian u64s that never go backwards, since samples lie back to back in their shard. A table
/// that breaks that was not written by `stoker-loader index`, and planning from it would ask S3
/// for ranges that end before they start.
fn offsets_table(bytes: &[u8]) -> Result<Vec<u64>, String> {
    if !bytes.len().is_multiple_of(8) {
        return Err(format!(
            "{} bytes is not a whole number of offsets",
            bytes.len()
        ));
    }
    let offsets: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    match offsets.windows(2).position(|w| w[1] < w[0]) {
        Some(i) => Err(format!(
            "offset {} ({}) comes before offset {i} ({}): offsets go backwards",
            i + 1,
            offsets[i + 1],
            offsets[i]
        )),
        None => Ok(offsets),
    }
}

async fn read(
    source: &S3Source,
    location: &ManifestLocation,
    name: &str,
    range: Option<Range<u64>>,
) -> Result<Bytes, IndexError> {
    match location {
        ManifestLocation::S3 { bucket, key } => {
            Ok(source.get_range(bucket, &join(key, name), range).await?)
        }
        ManifestLocation::File(dir) => {
            let io = |source| IndexError::Io {
                location: location.to_string(),
                source,
            };
            let path = dir.join(name);
            let Some(r) = range else {
                return Ok(tokio::fs::read(path).await.map_err(io)?.into());
            };
            use tokio::io::{AsyncReadExt, AsyncSeekExt};
            let mut file = tokio::fs::File::open(path).await.map_err(io)?;
            file.seek(std::io::SeekFrom::Start(r.start))
                .await
                .map_err(io)?;
            let mut out = Vec::with_capacity((r.end - r.start) as usize);
            file.take(r.end - r.start)
                .read_to_end(&mut out)
                .await
                .map_err(io)?;
            Ok(out.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offsets_table_that_goes_backwards_or_is_cut_is_refused() {
        let table = |v: &[u64]| v.iter().flat_map(|o| o.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(
            offsets_table(&table(&[0, 1024, 1024, 4096])),
            Ok(vec![0, 1024, 1024, 4096])
        );
        let err = offsets_table(&table(&[0, 4096, 1024])).unwrap_err();
        assert!(
            err.contains("offset 2 (1024) comes before offset 1 (4096)"),
            "{err}"
        );
        let mut cut = table(&[0, 512]);
        cut.pop();
        assert!(
            offsets_table(&cut)
                .unwrap_err()
                .contains("not a whole number")
        );
    }

    #[test]
    fn braces_expand_with_their_padding() {
        let keys = expand_braces("laion/{00000..00003}.tar").unwrap();
        assert_eq!(
            keys,
            [
                "laion/00000.tar",
                "laion/00001.tar",
                "laion/00002.tar",
                "laion/00003.tar"
            ]
        );
        assert_eq!(expand_braces("a/{8..10}-{0..1}.tar").unwrap().len(), 6);
        assert_eq!(expand_braces("plain.tar").unwrap(), ["plain.tar"]);
        let err = expand_braces("laion/{a..b}.tar").unwrap_err().to_string();
        assert!(
            err.contains("laion/{a..b}.tar") && err.contains("numbers"),
            "{err}"
        );
        assert!(expand_braces("x/{3..1}.tar").is_err());
    }
}
