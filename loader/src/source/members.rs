//! Fetching one batch's samples: whole objects with one GET each; samples inside shards with
//! range GETs, one per run of neighbouring samples of the same shard (coalesced when the gap
//! between them is small), never the whole shard per sample. Each ranged sample is then split
//! into its image and its fields (caption, label, ...), which travel as the sample's metadata;
//! a Parquet row's span is its data page, decoded once per span for every row asked of it.

use std::collections::HashMap;
use std::ops::Range;

use bytes::Bytes;
use futures::future::join_all;

use super::parquet::{ParquetValue, decode_page};
use super::tar::{TarError, split_sample};
use super::{S3Source, SampleRef, SourceError};
use crate::batch::EncodedSample;
use crate::decode::SkipReason;

impl From<crate::proto::SampleRef> for SampleRef {
    fn from(s: crate::proto::SampleRef) -> Self {
        SampleRef {
            key: s.key,
            metadata: s.metadata,
            range: (s.length > 0).then(|| s.offset..s.offset.saturating_add(s.length)),
            parquet: s.parquet.map(|p| ParquetValue {
                page_rows: p.page_rows,
                row: p.row,
                codec: p.codec,
                max_def_level: p.max_def_level,
                dictionary: (p.dictionary_length > 0).then(|| {
                    p.dictionary_offset..p.dictionary_offset.saturating_add(p.dictionary_length)
                }),
            }),
        }
    }
}

impl From<&SampleRef> for crate::proto::SampleRef {
    fn from(s: &SampleRef) -> Self {
        let (offset, length) = s
            .range
            .as_ref()
            .map_or((0, 0), |r| (r.start, r.end.saturating_sub(r.start)));
        crate::proto::SampleRef {
            key: s.key.clone(),
            metadata: s.metadata.clone(),
            inline: Bytes::new(),
            offset,
            length,
            parquet: s.parquet.as_ref().map(|p| {
                let (dictionary_offset, dictionary_length) = p
                    .dictionary
                    .as_ref()
                    .map_or((0, 0), |r| (r.start, r.end.saturating_sub(r.start)));
                crate::proto::ParquetValue {
                    page_rows: p.page_rows,
                    row: p.row,
                    codec: p.codec.clone(),
                    max_def_level: p.max_def_level,
                    dictionary_offset,
                    dictionary_length,
                }
            }),
        }
    }
}

/// When two ranged samples of one shard share a GET.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalescePolicy {
    /// Largest gap between two samples still fetched in one GET (the gap's bytes are read and
    /// dropped: cheaper than a request up to about one request's latency worth of bandwidth).
    pub max_gap: u64,
    /// Largest span one GET covers.
    pub max_span: u64,
}

impl Default for CoalescePolicy {
    fn default() -> Self {
        Self {
            max_gap: 256 * 1024,
            max_span: 16 * 1024 * 1024,
        }
    }
}

/// One GET: a span of a shard and the samples (indices into the batch) inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    pub key: String,
    pub range: Range<u64>,
    pub samples: Vec<usize>,
}

/// Groups the ranged samples of a batch into GET spans, pure.
pub(crate) fn coalesce(samples: &[SampleRef], policy: CoalescePolicy) -> Vec<Span> {
    let mut ranged: Vec<(usize, &str, Range<u64>)> = samples
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.range.clone().map(|r| (i, s.key.as_str(), r)))
        .collect();
    ranged.sort_by(|a, b| (a.1, a.2.start).cmp(&(b.1, b.2.start)));
    let mut spans: Vec<Span> = Vec::new();
    for (i, key, range) in ranged {
        if let Some(last) = spans.last_mut()
            && last.key == key
            && range.start <= last.range.end.saturating_add(policy.max_gap)
            && range.end.max(last.range.end) - last.range.start <= policy.max_span
        {
            last.range.end = last.range.end.max(range.end);
            last.samples.push(i);
            continue;
        }
        spans.push(Span {
            key: key.to_string(),
            range,
            samples: vec![i],
        });
    }
    spans
}

/// Fetches every sample of a batch, in the batch's order. A sample that cannot be fetched or
/// split is a skip with its reason, logged with its key and range; the rest are delivered.
pub async fn fetch_samples(
    source: Option<&S3Source>,
    bucket: &str,
    samples: &[SampleRef],
    policy: CoalescePolicy,
) -> Vec<EncodedSample> {
    let mut out: Vec<EncodedSample> = samples
        .iter()
        .map(|s| EncodedSample {
            key: s.key.clone(),
            metadata: s.metadata.clone(),
            data: Err(SkipReason::S3Error),
        })
        .collect();
    let Some(source) = source else {
        tracing::warn!("no S3 source configured; skipping the batch's samples");
        return out;
    };
    let whole = samples
        .iter()
        .enumerate()
        .filter(|(_, s)| s.range.is_none())
        .map(|(i, s)| async move { (i, source.get_sample(bucket, &s.key, None).await) });
    let spans = coalesce(samples, policy);
    let ranged = spans.iter().map(|span| async move {
        let got = source
            .get_sample(bucket, &span.key, Some(span.range.clone()))
            .await;
        (span, got)
    });
    // Dictionary pages of the batch's dictionary-encoded Parquet pages, each fetched once.
    let mut wanted: Vec<(&str, Range<u64>)> = samples
        .iter()
        .filter_map(|s| Some((s.key.as_str(), s.parquet.as_ref()?.dictionary.clone()?)))
        .collect();
    wanted.sort_by_key(|(k, r)| (*k, r.start));
    wanted.dedup();
    let dictionaries = wanted.into_iter().map(|(key, r)| async move {
        let got = source.get_range(bucket, key, Some(r.clone())).await;
        ((key, r.start), got)
    });
    let (whole, ranged, dictionaries) =
        futures::join!(join_all(whole), join_all(ranged), join_all(dictionaries));
    let dictionaries: HashMap<(&str, u64), Result<Bytes, SourceError>> =
        dictionaries.into_iter().collect();
    for (i, got) in whole {
        out[i].data = got.map_err(|e| {
            tracing::warn!(key = %samples[i].key, reason = %e.skip_reason(), error = %e, "skipping sample");
            e.skip_reason()
        });
    }
    for (span, got) in ranged {
        let mut pages = HashMap::new();
        for &i in &span.samples {
            let Some(range) = samples[i].range.clone() else {
                continue;
            };
            if let (Ok(bytes), Some(value)) = (&got, &samples[i].parquet) {
                let dictionary = value
                    .dictionary
                    .as_ref()
                    .and_then(|d| dictionaries.get(&(span.key.as_str(), d.start)));
                let page = Page {
                    key: &span.key,
                    span: bytes,
                    span_start: span.range.start,
                    range,
                    value,
                    dictionary,
                };
                out[i].data = page.row(&mut pages);
                if let Err(reason) = &out[i].data {
                    tracing::warn!(key = %span.key, row = %samples[i].metadata, %reason, "skipping parquet row");
                }
                continue;
            }
            let (data, metadata) = match &got {
                Ok(bytes) => sample_of(bytes, span.range.start, range.clone()),
                Err(e) => {
                    tracing::warn!(key = %span.key, range = ?range, reason = %e.skip_reason(), error = %e, "skipping sample");
                    (Err(e.skip_reason()), None)
                }
            };
            if let Err(reason) = data {
                tracing::warn!(key = %span.key, range = ?range, %reason, "skipping shard sample");
            }
            let entry = &mut out[i];
            entry.data = data;
            entry.metadata = merge_metadata(&entry.metadata, metadata.as_deref(), &range);
        }
    }
    out
}

/// Decoded pages of one span, by their start: each page is decoded once for all its rows.
type DecodedPages = HashMap<u64, Result<Vec<Option<Bytes>>, SkipReason>>;

/// A Parquet row's data page inside its span, with its dictionary page when it needs one.
struct Page<'a> {
    key: &'a str,
    span: &'a Bytes,
    span_start: u64,
    range: Range<u64>,
    value: &'a ParquetValue,
    dictionary: Option<&'a Result<Bytes, SourceError>>,
}

impl Page<'_> {
    /// The row's image bytes, or why it is skipped: a page cut short (the file ends early) is
    /// truncated; one that does not decode (bad compression, levels or lengths) is corrupt,
    /// for each of its rows; a row without an image is empty.
    fn row(&self, pages: &mut DecodedPages) -> Result<Bytes, SkipReason> {
        // A page that does not decode is logged once, with why; each of its rows is skipped.
        let decoded = pages.entry(self.range.start).or_insert_with(|| {
            self.decode().map_err(|(reason, detail)| {
                tracing::warn!(key = %self.key, range = ?self.range, %detail, "parquet page does not decode");
                reason
            })
        });
        match decoded {
            Ok(rows) => rows
                .get(self.value.row as usize)
                .cloned()
                .ok_or(SkipReason::Corrupt)?
                .ok_or(SkipReason::Empty),
            Err(reason) => Err(*reason),
        }
    }

    fn decode(&self) -> Result<Vec<Option<Bytes>>, (SkipReason, String)> {
        let from = (self.range.start - self.span_start) as usize;
        let to = (self.range.end - self.span_start) as usize;
        if to > self.span.len() {
            return Err((
                SkipReason::Truncated,
                "the file ends inside the page".into(),
            ));
        }
        let dictionary = match self.dictionary {
            None if self.value.dictionary.is_some() => {
                return Err((SkipReason::S3Error, "dictionary page not fetched".into()));
            }
            None => None,
            Some(Ok(d)) => Some(d.clone()),
            Some(Err(e)) => return Err((e.skip_reason(), e.to_string())),
        };
        decode_page(self.span.slice(from..to), dictionary, self.value)
            .map_err(|detail| (SkipReason::Corrupt, detail))
    }
}

/// One sample's image bytes and fields from its span's bytes (shorter than asked when the
/// shard ends early).
fn sample_of(
    span: &Bytes,
    span_start: u64,
    range: Range<u64>,
) -> (Result<Bytes, SkipReason>, Option<String>) {
    let from = (range.start - span_start) as usize;
    let end = (range.end - span_start) as usize;
    let to = end.min(span.len());
    if from >= to {
        return (Err(SkipReason::Truncated), None);
    }
    // The shard ended inside this sample: whatever member is missing, the cut is the cause.
    let cut = to < end;
    let bytes = span.slice(from..to);
    match split_sample(&bytes) {
        Ok(parts) => (Ok(bytes.slice(parts.image)), Some(parts.metadata)),
        Err(_) if cut => (Err(SkipReason::Truncated), None),
        Err(TarError::Truncated { .. }) => (Err(SkipReason::Truncated), None),
        Err(TarError::NoImage { .. }) => (Err(SkipReason::Unsupported), None),
        Err(TarError::BadHeader { .. }) => (Err(SkipReason::Corrupt), None),
    }
}

/// The request's metadata (usually empty for shards) with the sample's own fields over it;
/// a sample whose fields could not be read carries its byte range, so a skip names it.
fn merge_metadata(asked: &str, fields: Option<&str>, range: &Range<u64>) -> String {
    let mut obj = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(asked)
        .unwrap_or_default();
    match fields.and_then(|f| serde_json::from_str::<serde_json::Map<_, _>>(f).ok()) {
        Some(own) => obj.extend(own),
        None => {
            obj.insert(
                "__range__".into(),
                format!("{}-{}", range.start, range.end).into(),
            );
        }
    }
    serde_json::Value::Object(obj).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(key: &str, range: Range<u64>) -> SampleRef {
        SampleRef {
            key: key.into(),
            range: Some(range),
            ..SampleRef::default()
        }
    }

    #[test]
    fn neighbours_share_a_get_and_far_samples_do_not() {
        let policy = CoalescePolicy {
            max_gap: 100,
            max_span: 10_000,
        };
        let batch = vec![
            at("b.tar", 2000..2500),
            at("a.tar", 0..1000),
            SampleRef {
                key: "whole.jpg".into(),
                ..SampleRef::default()
            },
            at("a.tar", 1000..1500),
            at("a.tar", 1550..2000),
            at("a.tar", 9000..9500),
            at("b.tar", 0..500),
        ];
        let spans = coalesce(&batch, policy);
        let got: Vec<(&str, Range<u64>, Vec<usize>)> = spans
            .iter()
            .map(|s| (s.key.as_str(), s.range.clone(), s.samples.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a.tar", 0..2000, vec![1, 3, 4]),
                ("a.tar", 9000..9500, vec![5]),
                ("b.tar", 0..500, vec![6]),
                ("b.tar", 2000..2500, vec![0]),
            ]
        );
        let capped = coalesce(
            &batch,
            CoalescePolicy {
                max_gap: 100,
                max_span: 1200,
            },
        );
        assert_eq!(capped[0].range, 0..1000, "the span cap splits a run");
    }
}
