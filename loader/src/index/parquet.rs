//! The index of Parquet files: per file its footer read once, the image column's pages found by
//! walking their headers (small range GETs, never the images), and the metadata columns read
//! into one JSON object per row. A file's table is one JSON line of `parquet.jsonl`, which a
//! sidecar range-reads when its shuffle window reaches the file.

use std::sync::Arc;

use bytes::Bytes;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader, RowGroupMetaData};
use parquet::file::properties::ReaderProperties;
use parquet::file::reader::{ChunkReader, Length, RowGroupReader};
use parquet::file::serialized_reader::SerializedRowGroupReader;
use parquet::schema::types::Type;
use serde::{Deserialize, Serialize};

use super::{IndexError, IndexProblem, ShardEntry};
use crate::source::parquet::{
    MAX_HEADER_BYTES, PageKind, ParquetValue, codec_name, read_page_header,
};
use crate::source::{S3Source, SampleRef, SourceError};

/// Bytes read from a file's end first: the footer's length and the `PAR1` magic. Not more: a
/// suffix range longer than the object is the whole object on S3, but some S3-compatible
/// servers (s3s-fs) answer it with an error.
const TAIL_BYTES: u64 = 8;

/// The metadata field naming a sample's row in its file, so a skip names it.
pub const ROW_FIELD: &str = "__row__";

/// Which columns make a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParquetColumns {
    /// The image bytes: a binary column, or a struct with a `bytes` field (Hugging Face's
    /// `Image` feature).
    pub image: String,
    /// Top-level columns carried as the sample's metadata.
    pub fields: Vec<String>,
}

/// One data page of the image column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageEntry {
    /// Header and data, in the file.
    pub range: [u64; 2],
    pub rows: u32,
    /// Index into [`FileTable::chunks`]: the column chunk the page belongs to.
    pub chunk: u32,
    /// Whether its values index the chunk's dictionary page.
    pub dictionary: bool,
}

/// One column chunk (row group) of the image column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkEntry {
    pub codec: String,
    pub dictionary: Option<[u64; 2]>,
}

/// What the index keeps of one file: its pages, and each row's metadata as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileTable {
    pub max_def_level: u32,
    pub chunks: Vec<ChunkEntry>,
    pub pages: Vec<PageEntry>,
    /// One JSON object per indexed row, in file order (rows of left-out row groups skipped).
    pub fields: Vec<String>,
}

impl FileTable {
    /// The decode request's sample for row `index` of the indexed rows.
    pub fn sample_ref(&self, key: &str, index: u32) -> Option<SampleRef> {
        let mut first = 0u32;
        let page = self.pages.iter().find(|p| {
            first += p.rows;
            index < first
        })?;
        let chunk = self.chunks.get(page.chunk as usize)?;
        Some(SampleRef {
            key: key.into(),
            metadata: self.fields.get(index as usize)?.clone(),
            range: Some(page.range[0]..page.range[1]),
            parquet: Some(ParquetValue {
                page_rows: page.rows,
                row: index - (first - page.rows),
                codec: chunk.codec.clone(),
                max_def_level: self.max_def_level,
                dictionary: page
                    .dictionary
                    .then_some(chunk.dictionary)
                    .flatten()
                    .map(|[a, b]| a..b),
            }),
        })
    }
}

/// One file indexed.
pub struct IndexedFile {
    pub entry: ShardEntry,
    pub table: FileTable,
    pub problems: Vec<IndexProblem>,
}

/// Indexes one file. A file without a readable footer (cut short, not Parquet) is left out and
/// reported, as is a row group whose pages cannot be walked; a file that lacks the columns is
/// an error of the whole index: the dataset is not what the pipeline names.
pub async fn index_file(
    source: &S3Source,
    bucket: &str,
    key: &str,
    columns: &ParquetColumns,
) -> Result<IndexedFile, IndexError> {
    let bad = |detail: String| IndexError::Format {
        location: format!("s3://{bucket}/{key}"),
        detail,
    };
    let (metadata, size) = match read_footer(source, bucket, key).await {
        Ok(found) => found,
        Err(FooterError::Source(e)) => return Err(IndexError::Source(e)),
        Err(FooterError::Format(reason)) => return Ok(IndexedFile::left_out(key, reason)),
    };
    let schema = metadata.file_metadata().schema_descr();
    let image = image_column(schema, &columns.image).map_err(bad)?;
    let descr = schema.column(image);
    let projection = field_projection(schema.root_schema(), &columns.fields).map_err(bad)?;
    let mut table = FileTable {
        max_def_level: descr.max_def_level() as u32,
        chunks: Vec::new(),
        pages: Vec::new(),
        fields: Vec::new(),
    };
    let mut problems = Vec::new();
    let mut first_row = 0u64;
    for (g, group) in metadata.row_groups().iter().enumerate() {
        let rows = group.num_rows() as u64;
        let chunk = group.column(image);
        let chunks_before = table.chunks.len();
        let outcome = match codec_name(chunk.compression()) {
            None => Err(format!("codec {} is not supported", chunk.compression())),
            Some(codec) => walk_pages(source, bucket, key, group, image, codec, &mut table).await,
        };
        let fields = match (&outcome, &projection) {
            (Err(_), _) => Ok(Vec::new()),
            (Ok(()), None) => Ok((first_row..first_row + rows).map(row_only).collect()),
            (Ok(()), Some(p)) => read_fields(source, bucket, key, &metadata, g, p, first_row).await,
        };
        match (outcome, fields) {
            (Ok(()), Ok(f)) if f.len() as u64 == rows => table.fields.extend(f),
            (outcome, fields) => {
                let reason = match (outcome, fields) {
                    (Err(e), _) | (_, Err(e)) => e,
                    (_, Ok(f)) => format!("{} metadata rows for {rows} rows", f.len()),
                };
                // Undo what the walk added for this row group.
                table.pages.retain(|p| (p.chunk as usize) < chunks_before);
                table.chunks.truncate(chunks_before);
                problems.push(IndexProblem {
                    key: key.into(),
                    offset: chunk.byte_range().0,
                    reason: format!(
                        "row group {g} (rows {first_row}..{}) left out: {reason}",
                        first_row + rows
                    ),
                });
            }
        }
        first_row += rows;
    }
    let samples = table.pages.iter().map(|p| u64::from(p.rows)).sum::<u64>();
    Ok(IndexedFile {
        entry: ShardEntry {
            key: key.into(),
            samples: u32::try_from(samples).map_err(|_| bad(format!("{samples} rows")))?,
            bytes: size,
            table: None,
        },
        table,
        problems,
    })
}

impl IndexedFile {
    fn left_out(key: &str, reason: String) -> Self {
        IndexedFile {
            entry: ShardEntry {
                key: key.into(),
                samples: 0,
                bytes: 0,
                table: None,
            },
            table: FileTable {
                max_def_level: 0,
                chunks: Vec::new(),
                pages: Vec::new(),
                fields: Vec::new(),
            },
            problems: vec![IndexProblem {
                key: key.into(),
                offset: 0,
                reason: format!("file left out: {reason}"),
            }],
        }
    }
}

fn row_only(row: u64) -> String {
    serde_json::json!({ ROW_FIELD: row }).to_string()
}

enum FooterError {
    Source(SourceError),
    Format(String),
}

async fn read_footer(
    source: &S3Source,
    bucket: &str,
    key: &str,
) -> Result<(ParquetMetaData, u64), FooterError> {
    let (tail, size) = source
        .get_tail(bucket, key, TAIL_BYTES)
        .await
        .map_err(FooterError::Source)?;
    let n = tail.len();
    if n < 8 || size < 12 || &tail[n - 4..] != b"PAR1" {
        return Err(FooterError::Format(format!(
            "not a Parquet file: no PAR1 magic at the end of its {size} bytes (cut short?)"
        )));
    }
    let len = u64::from(u32::from_le_bytes([
        tail[n - 8],
        tail[n - 7],
        tail[n - 6],
        tail[n - 5],
    ]));
    let footer = if len + 12 <= size {
        let at = size - 8 - len;
        source
            .get_range(bucket, key, Some(at..size - 8))
            .await
            .map_err(FooterError::Source)?
    } else {
        return Err(FooterError::Format(format!(
            "footer of {len} bytes in a file of {size}"
        )));
    };
    let metadata = ParquetMetaDataReader::decode_metadata(&footer)
        .map_err(|e| FooterError::Format(format!("footer: {e}")))?;
    Ok((metadata, size))
}

/// The leaf column holding the image bytes: `name` itself, or `name.bytes`.
fn image_column(
    schema: &parquet::schema::types::SchemaDescriptor,
    name: &str,
) -> Result<usize, String> {
    let wanted = [name.to_string(), format!("{name}.bytes")];
    let found = schema
        .columns()
        .iter()
        .position(|c| wanted.contains(&c.path().string()))
        .ok_or_else(|| {
            let have: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
            format!(
                "no image column {name:?} (nor {name}.bytes); columns: {}",
                have.join(", ")
            )
        })?;
    let c = schema.column(found);
    if c.physical_type() != parquet::basic::Type::BYTE_ARRAY || c.max_rep_level() != 0 {
        return Err(format!(
            "image column {} must be binary, one value per row (it is {} with repetition level {})",
            c.path().string(),
            c.physical_type(),
            c.max_rep_level()
        ));
    }
    Ok(found)
}

/// The schema of the metadata columns, `None` when there are none.
fn field_projection(root: &Type, names: &[String]) -> Result<Option<Type>, String> {
    if names.is_empty() {
        return Ok(None);
    }
    let fields = root.get_fields();
    let mut picked = Vec::with_capacity(names.len());
    for name in names {
        let f = fields.iter().find(|f| f.name() == name).ok_or_else(|| {
            let have: Vec<&str> = fields.iter().map(|f| f.name()).collect();
            format!("no column {name:?}; columns: {}", have.join(", "))
        })?;
        picked.push(f.clone());
    }
    Type::group_type_builder(root.name())
        .with_fields(picked)
        .build()
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Walks the image column's pages in row group `group`, appending a chunk and its pages.
async fn walk_pages(
    source: &S3Source,
    bucket: &str,
    key: &str,
    group: &RowGroupMetaData,
    image: usize,
    codec: &str,
    table: &mut FileTable,
) -> Result<(), String> {
    let chunk = group.column(image);
    let (start, len) = chunk.byte_range();
    let end = start + len;
    let index = table.chunks.len() as u32;
    table.chunks.push(ChunkEntry {
        codec: codec.into(),
        dictionary: None,
    });
    // Headers are read through a window that a GET refills when a header is not inside it,
    // so small pages cost one GET per window, not one per page.
    let mut window = (start, Bytes::new());
    let (mut at, mut rows) = (start, 0u64);
    while at < end {
        let header = loop {
            let from = (at - window.0) as usize;
            let parsed = (at >= window.0 && from < window.1.len())
                .then(|| read_page_header(&window.1[from..]));
            match parsed {
                Some(Ok(h)) => break h,
                Some(Err(e)) if !e.contains("cut short") || window.0 == at => {
                    return Err(format!("page header at byte {at}: {e}"));
                }
                _ => {
                    let to = (at + MAX_HEADER_BYTES).min(end);
                    let bytes = source
                        .get_range(bucket, key, Some(at..to))
                        .await
                        .map_err(|e| e.to_string())?;
                    window = (at, bytes);
                }
            }
        };
        let page_end = at + header.total_len();
        if page_end > end {
            return Err(format!(
                "page at byte {at} ends at {page_end}, past its column chunk's end {end}"
            ));
        }
        match header.kind {
            PageKind::Dictionary => table.chunks[index as usize].dictionary = Some([at, page_end]),
            PageKind::Data => {
                rows += u64::from(header.rows);
                table.pages.push(PageEntry {
                    range: [at, page_end],
                    rows: header.rows,
                    chunk: index,
                    dictionary: header.uses_dictionary(),
                });
            }
            PageKind::Other => {}
        }
        at = page_end;
    }
    let want = group.num_rows() as u64;
    if rows != want {
        return Err(format!("pages hold {rows} rows, the row group {want}"));
    }
    Ok(())
}

/// Byte ranges of one file fetched for reading rows: the `parquet` crate reads through it.
struct Pieces(Vec<(u64, Bytes)>);

impl Pieces {
    fn find(&self, start: u64, len: u64) -> parquet::errors::Result<(&Bytes, usize)> {
        self.0
            .iter()
            .find(|(at, b)| *at <= start && start + len <= at + b.len() as u64)
            .map(|(at, b)| (b, (start - at) as usize))
            .ok_or_else(|| {
                parquet::errors::ParquetError::EOF(format!(
                    "bytes {start}..{} were not fetched",
                    start + len
                ))
            })
    }
}

impl Length for Pieces {
    fn len(&self) -> u64 {
        self.0
            .iter()
            .map(|(at, b)| at + b.len() as u64)
            .max()
            .unwrap_or(0)
    }
}

impl ChunkReader for Pieces {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        use bytes::Buf;
        // At least one byte: a piece that ends where the next begins must not answer for it.
        let (b, from) = self.find(start, 1)?;
        Ok(b.slice(from..).reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let (b, from) = self.find(start, length as u64)?;
        Ok(b.slice(from..from + length))
    }
}

/// The metadata columns of row group `g`, one JSON object per row with its row number.
async fn read_fields(
    source: &S3Source,
    bucket: &str,
    key: &str,
    metadata: &ParquetMetaData,
    g: usize,
    projection: &Type,
    first_row: u64,
) -> Result<Vec<String>, String> {
    let group = metadata.row_group(g);
    let names: Vec<&str> = projection.get_fields().iter().map(|f| f.name()).collect();
    let mut pieces = Vec::new();
    for c in group.columns() {
        if names.contains(&c.column_path().parts()[0].as_str()) {
            let (at, len) = c.byte_range();
            let bytes = source
                .get_range(bucket, key, Some(at..at + len))
                .await
                .map_err(|e| e.to_string())?;
            pieces.push((at, bytes));
        }
    }
    let reader = SerializedRowGroupReader::new(
        Arc::new(Pieces(pieces)),
        group,
        metadata.page_index_for_row_group(g),
        Arc::new(ReaderProperties::builder().build()),
    )
    .map_err(|e| e.to_string())?;
    let rows = reader
        .get_row_iter(Some(projection.clone()))
        .map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(group.num_rows() as usize);
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| format!("metadata columns: {e}"))?;
        let mut value = row.to_json_value();
        if let Some(obj) = value.as_object_mut() {
            obj.insert(ROW_FIELD.into(), (first_row + i as u64).into());
        }
        out.push(value.to_string());
    }
    Ok(out)
}
