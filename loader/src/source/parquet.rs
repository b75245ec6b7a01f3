//! Parquet sources: images stored as bytes in a column (the Hugging Face datasets layout, an
//! `image` struct of `bytes` and `path`, or a plain binary column), with other columns
//! (caption, label, ...) carried as the sample's metadata.
//!
//! A sample is one row: the index (`crate::index::build_parquet`) reads each file's footer and
//! walks the image column's page headers with small range GETs (never the image bytes), so it
//! knows which data page holds each row. A decoder then range-GETs that page (and the column
//! chunk's dictionary page when the page is dictionary-encoded) and decodes it with the
//! `parquet` crate. A page holds every image written into it (pyarrow's default data page is
//! 1 MiB), so a sample costs its page's bytes unless page-mates share the batch: image datasets
//! read best with small pages (`data_page_size` near one image), which `profile` shows as bytes
//! per sample.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use parquet::basic::{Compression, GzipLevel, Repetition, Type as PhysicalType, ZstdLevel};
use parquet::column::page::PageReader;
use parquet::column::reader::ColumnReaderImpl;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::page_index::offset_index::PageLocation;
use parquet::file::reader::{ChunkReader, Length};
use parquet::file::serialized_reader::SerializedPageReader;
use parquet::schema::types::{ColumnDescriptor, ColumnPath, Type};
use serde::{Deserialize, Serialize};

/// Where a row's image lives in its file, beyond the sample's byte range (the data page).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ParquetValue {
    /// Rows in the page, and this sample's row among them.
    pub page_rows: u32,
    pub row: u32,
    /// The column chunk's codec ([`codec_name`]).
    pub codec: String,
    /// The image column's maximum definition level (0: required; 2 for `image.bytes` in an
    /// optional struct): a row below it has no image.
    pub max_def_level: u32,
    /// The column chunk's dictionary page, when this page is dictionary-encoded.
    pub dictionary: Option<Range<u64>>,
}

/// The codec's name in a [`ParquetValue`]: what pyarrow calls it, lower case.
pub fn codec_name(c: Compression) -> Option<&'static str> {
    Some(match c {
        Compression::UNCOMPRESSED => "uncompressed",
        Compression::SNAPPY => "snappy",
        Compression::GZIP(_) => "gzip",
        Compression::LZ4 => "lz4",
        Compression::LZ4_RAW => "lz4_raw",
        Compression::ZSTD(_) => "zstd",
        // brotli and lzo: not built in (rare for image data, which does not compress).
        _ => return None,
    })
}

fn codec(name: &str) -> Option<Compression> {
    Some(match name {
        "uncompressed" => Compression::UNCOMPRESSED,
        "snappy" => Compression::SNAPPY,
        "gzip" => Compression::GZIP(GzipLevel::default()),
        "lz4" => Compression::LZ4,
        "lz4_raw" => Compression::LZ4_RAW,
        "zstd" => Compression::ZSTD(ZstdLevel::default()),
        _ => return None,
    })
}

/// What a page header says (Thrift compact protocol, parquet.thrift's `PageHeader`): enough
/// to walk a column chunk's pages without reading their data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    pub kind: PageKind,
    /// Bytes of the header itself; the page's data follows.
    pub header_len: u64,
    /// Bytes of the page's (compressed) data after the header.
    pub data_len: u64,
    /// Values (v1 data and dictionary pages) or rows (v2 data pages) in the page.
    pub rows: u32,
    /// The values' encoding (parquet.thrift `Encoding`): 2 and 8 are dictionary indices.
    pub encoding: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    Data,
    Dictionary,
    /// Index pages and kinds this reader does not know: skipped.
    Other,
}

impl PageHeader {
    pub fn total_len(&self) -> u64 {
        self.header_len + self.data_len
    }

    /// Whether the values are indices into the chunk's dictionary page.
    pub fn uses_dictionary(&self) -> bool {
        // PLAIN_DICTIONARY (2, Parquet 1.0 writers) and RLE_DICTIONARY (8).
        self.kind == PageKind::Data && matches!(self.encoding, 2 | 8)
    }
}

/// Longest header read while walking pages: page statistics of a binary column can carry a
/// min and max value, which writers cap at a few KiB.
pub const MAX_HEADER_BYTES: u64 = 64 * 1024;

/// Reads the page header at the front of `buf`.
pub fn read_page_header(buf: &[u8]) -> Result<PageHeader, String> {
    let mut r = Compact { buf, at: 0 };
    let (mut kind, mut data_len, mut rows, mut encoding) = (None, None, None, 0);
    r.read_struct(&mut |r, id, ty| {
        match (id, ty) {
            (1, T_I32) => {
                kind = Some(match r.varint_i32()? {
                    0 | 3 => PageKind::Data,
                    2 => PageKind::Dictionary,
                    _ => PageKind::Other,
                })
            }
            (3, T_I32) => data_len = Some(r.varint_i32()?),
            // data_page_header and dictionary_page_header: num_values (1) and encoding (2).
            (5 | 7, T_STRUCT) => r.read_struct(&mut |r, id, ty| {
                match (id, ty) {
                    (1, T_I32) => rows = Some(r.varint_i32()?),
                    (2, T_I32) => encoding = r.varint_i32()?,
                    _ => r.skip(ty)?,
                }
                Ok(())
            })?,
            // data_page_header_v2: num_rows (3) and encoding (4).
            (8, T_STRUCT) => r.read_struct(&mut |r, id, ty| {
                match (id, ty) {
                    (3, T_I32) => rows = Some(r.varint_i32()?),
                    (4, T_I32) => encoding = r.varint_i32()?,
                    _ => r.skip(ty)?,
                }
                Ok(())
            })?,
            _ => r.skip(ty)?,
        }
        Ok(())
    })?;
    let kind = kind.ok_or("page header without a type")?;
    let data_len = data_len.ok_or("page header without a compressed size")?;
    let data_len = u64::try_from(data_len).map_err(|_| format!("page size {data_len}"))?;
    let rows = match (kind, rows) {
        (PageKind::Other, _) => 0,
        (_, Some(n)) => u32::try_from(n).map_err(|_| format!("{n} values in a page"))?,
        (_, None) => return Err("data page header without a value count".into()),
    };
    Ok(PageHeader {
        kind,
        header_len: r.at as u64,
        data_len,
        rows,
        encoding,
    })
}

const T_TRUE: u8 = 1;
const T_FALSE: u8 = 2;
const T_BYTE: u8 = 3;
const T_I16: u8 = 4;
const T_I32: u8 = 5;
const T_I64: u8 = 6;
const T_DOUBLE: u8 = 7;
const T_BINARY: u8 = 8;
const T_LIST: u8 = 9;
const T_SET: u8 = 10;
const T_MAP: u8 = 11;
const T_STRUCT: u8 = 12;

/// A reader of the Thrift compact protocol, as far as page headers need it.
struct Compact<'a> {
    buf: &'a [u8],
    at: usize,
}

type FieldFn<'f, 'a> = dyn FnMut(&mut Compact<'a>, i16, u8) -> Result<(), String> + 'f;

impl<'a> Compact<'a> {
    fn byte(&mut self) -> Result<u8, String> {
        let b = *self
            .buf
            .get(self.at)
            .ok_or("page header cut short (the range ends inside it)")?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes".into())
    }

    fn zigzag(&mut self) -> Result<i64, String> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    fn varint_i32(&mut self) -> Result<i32, String> {
        let v = self.zigzag()?;
        i32::try_from(v).map_err(|_| format!("{v} is not an i32"))
    }

    fn bytes(&mut self, n: u64) -> Result<(), String> {
        let end = self.at as u64 + n;
        if end > self.buf.len() as u64 {
            return Err("page header cut short (the range ends inside it)".into());
        }
        self.at = end as usize;
        Ok(())
    }

    /// Reads a struct's fields, handing each (id, type) to `field`, which reads or skips it.
    fn read_struct(&mut self, field: &mut FieldFn<'_, 'a>) -> Result<(), String> {
        let mut last = 0i16;
        loop {
            let head = self.byte()?;
            if head == 0 {
                return Ok(());
            }
            let ty = head & 0x0f;
            let delta = i16::from(head >> 4);
            let id = if delta == 0 {
                i16::try_from(self.zigzag()?).map_err(|_| "field id out of range")?
            } else {
                last + delta
            };
            last = id;
            // Booleans carry their value in the type nibble: nothing more to read.
            if matches!(ty, T_TRUE | T_FALSE) {
                continue;
            }
            field(self, id, ty)?;
        }
    }

    fn skip(&mut self, ty: u8) -> Result<(), String> {
        match ty {
            T_TRUE | T_FALSE | T_BYTE => self.bytes(u64::from(ty == T_BYTE)),
            T_I16 | T_I32 | T_I64 => self.varint().map(drop),
            T_DOUBLE => self.bytes(8),
            T_BINARY => {
                let n = self.varint()?;
                self.bytes(n)
            }
            T_LIST | T_SET => {
                let head = self.byte()?;
                let n = match u64::from(head >> 4) {
                    15 => self.varint()?,
                    n => n,
                };
                let elem = head & 0x0f;
                for _ in 0..n {
                    // Booleans in a collection take one byte each.
                    if matches!(elem, T_TRUE | T_FALSE) {
                        self.bytes(1)?;
                    } else {
                        self.skip(elem)?;
                    }
                }
                Ok(())
            }
            T_MAP => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let kv = self.byte()?;
                for _ in 0..n {
                    self.skip(kv >> 4)?;
                    self.skip(kv & 0x0f)?;
                }
                Ok(())
            }
            T_STRUCT => self.read_struct(&mut |r, _, ty| r.skip(ty)),
            _ => Err(format!("unknown Thrift type {ty} in a page header")),
        }
    }
}

/// The page's bytes (and its dictionary page's) laid out for the `parquet` crate's page reader:
/// the dictionary page at 0, the data page right after it.
struct FetchedPage {
    dictionary: Bytes,
    page: Bytes,
}

impl FetchedPage {
    fn slice(&self, start: u64, len: usize) -> parquet::errors::Result<Bytes> {
        let dict = self.dictionary.len() as u64;
        let (buf, from) = if start < dict {
            (&self.dictionary, start)
        } else {
            (&self.page, start - dict)
        };
        let from = from as usize;
        buf.get(from..from + len)
            .map(|_| buf.slice(from..from + len))
            .ok_or_else(|| {
                parquet::errors::ParquetError::EOF(format!(
                    "{len} bytes at {start} lie outside the fetched page"
                ))
            })
    }
}

impl Length for FetchedPage {
    fn len(&self) -> u64 {
        (self.dictionary.len() + self.page.len()) as u64
    }
}

impl ChunkReader for FetchedPage {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        use bytes::Buf;
        let dict = self.dictionary.len() as u64;
        let rest = if start < dict {
            self.dictionary.len() - start as usize
        } else {
            self.page.len().saturating_sub((start - dict) as usize)
        };
        Ok(self.slice(start, rest)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.slice(start, length)
    }
}

/// Decodes a data page of the image column: each row's image bytes (`None` for a row without
/// one), in row order. `dictionary` is the chunk's dictionary page when the page needs it.
pub fn decode_page(
    page: Bytes,
    dictionary: Option<Bytes>,
    value: &ParquetValue,
) -> Result<Vec<Option<Bytes>>, String> {
    let compression = codec(&value.codec).ok_or_else(|| format!("codec {:?}", value.codec))?;
    let max_def = i16::try_from(value.max_def_level).map_err(|_| "definition level")?;
    let repetition = if max_def > 0 {
        Repetition::OPTIONAL
    } else {
        Repetition::REQUIRED
    };
    let leaf = Type::primitive_type_builder("image", PhysicalType::BYTE_ARRAY)
        .with_repetition(repetition)
        .build()
        .map_err(|e| e.to_string())?;
    let descr = Arc::new(ColumnDescriptor::new(
        Arc::new(leaf),
        max_def,
        0,
        ColumnPath::new(vec!["image".into()]),
    ));
    let fetched = FetchedPage {
        dictionary: dictionary.unwrap_or_default(),
        page,
    };
    let dict_len = fetched.dictionary.len() as i64;
    let page_len = fetched.page.len();
    let meta = ColumnChunkMetaData::builder(descr.clone())
        .set_compression(compression)
        .set_dictionary_page_offset((dict_len > 0).then_some(0))
        .set_data_page_offset(dict_len)
        .set_total_compressed_size(dict_len + page_len as i64)
        .set_num_values(i64::from(value.page_rows))
        .build()
        .map_err(|e| e.to_string())?;
    let location = PageLocation {
        offset: dict_len,
        compressed_page_size: i32::try_from(page_len).map_err(|_| "page over 2 GiB")?,
        first_row_index: 0,
    };
    let rows = value.page_rows as usize;
    let pages = SerializedPageReader::new(Arc::new(fetched), &meta, rows, Some(vec![location]))
        .map_err(|e| e.to_string())?;
    let pages: Box<dyn PageReader> = Box::new(pages);
    let mut reader = ColumnReaderImpl::<ByteArrayType>::new(descr, pages);
    let (mut defs, mut values): (Vec<i16>, Vec<ByteArray>) = (Vec::new(), Vec::new());
    let mut read = 0;
    while read < rows {
        let (records, _, _) = reader
            .read_records(rows - read, Some(&mut defs), None, &mut values)
            .map_err(|e| e.to_string())?;
        if records == 0 {
            return Err(format!("the page holds {read} of its {rows} rows"));
        }
        read += records;
    }
    let mut values = values.into_iter();
    let mut out = Vec::with_capacity(rows);
    for i in 0..rows {
        let present = max_def == 0 || defs.get(i) == Some(&max_def);
        out.push(match present {
            // A copy out of the decompressed page: `ByteArray` does not hand its `Bytes` over.
            true => Some(Bytes::copy_from_slice(
                values.next().ok_or("fewer values than rows")?.data(),
            )),
            false => None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v1 data page header as parquet-cpp writes it: type 0, sizes, then a
    /// data_page_header with num_values 7 and encoding RLE_DICTIONARY, and statistics (a
    /// nested struct with binary min/max) that the reader skips.
    #[test]
    fn a_page_header_reads_with_its_statistics_skipped() {
        let mut h = vec![
            0x15, 0x00, // 1: i32 type = 0 (DATA_PAGE)
            0x15, 0x90, 0x01, // 2: i32 uncompressed = 72
            0x15, 0x80, 0x01, // 3: i32 compressed = 64
            0x2c, // 5: struct data_page_header
            0x15, 0x0e, // 1: num_values = 7
            0x15, 0x10, // 2: encoding = 8
            0x15, 0x06, // 3: definition level encoding = 3
            0x15, 0x06, // 4: repetition level encoding = 3
            0x1c, // 5: struct statistics
            0x18, 0x03, b'a', b'b', b'c', // 1: binary max
            0x18, 0x01, b'a', // 2: binary min
            0x00, // end of statistics
            0x00, // end of data_page_header
            0x00, // end of PageHeader
        ];
        let header_len = h.len() as u64;
        h.extend([0xAA; 64]);
        let got = read_page_header(&h).unwrap();
        assert_eq!(
            got,
            PageHeader {
                kind: PageKind::Data,
                header_len,
                data_len: 64,
                rows: 7,
                encoding: 8,
            }
        );
        assert!(got.uses_dictionary());
        let err = read_page_header(&h[..10]).unwrap_err();
        assert!(err.contains("cut short"), "{err}");
    }
}
