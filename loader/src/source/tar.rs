//! WebDataset tar shards, pure: walking 512-byte tar headers into members, grouping members
//! into samples (WebDataset's rule: a sample is the run of consecutive members that share the
//! name up to the first `.` of the file name), and splitting one sample's bytes into its image
//! and its fields (`.txt` caption, `.cls` label, `.json` object, other small text members).
//!
//! A sample's members are stored back to back, so a sample is one byte range of the shard,
//! from its first header to the end of its last member's padding: the index keeps only where
//! each sample starts (8 bytes per sample), and a decoder fetches the range and splits it here.

use std::ops::Range;

/// Tar block size: headers and member data are padded to it.
pub const BLOCK: u64 = 512;

/// Extensions taken as the sample's image, in order of preference.
const IMAGE_EXTENSIONS: [&str; 8] = ["jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm"];

/// Text members larger than this are not copied into the sample's metadata.
const MAX_FIELD_BYTES: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TarError {
    #[error("tar header at byte {offset}: {detail}")]
    BadHeader { offset: u64, detail: String },
    #[error("member {name:?} at byte {offset} ends at {end}, past the data's end {len}")]
    Truncated {
        name: String,
        offset: u64,
        end: u64,
        len: u64,
    },
    #[error("sample has no image member (members: {members})")]
    NoImage { members: String },
}

/// One regular file of a tar stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    /// Offset of the member's first header (long-name or pax headers included).
    pub header_offset: u64,
    /// Where its data starts and its size.
    pub data_offset: u64,
    pub size: u64,
}

impl Member {
    /// End of the member's data padded to the block: where the next header starts.
    pub fn end(&self) -> u64 {
        // The walker makes no member whose end would not fit; saturating all the same.
        padded(self.size).map_or(u64::MAX, |p| self.data_offset.saturating_add(p))
    }

    /// WebDataset's sample key: the path up to the first `.` of the file name.
    pub fn sample_key(&self) -> &str {
        split_name(&self.name).0
    }

    /// The extension after the key (`jpg`, `txt`, `seg.png`), lower case is not forced.
    pub fn extension(&self) -> &str {
        split_name(&self.name).1
    }
}

/// `size` rounded up to whole blocks; `None` when that does not fit in a u64.
fn padded(size: u64) -> Option<u64> {
    size.checked_next_multiple_of(BLOCK)
}

fn split_name(name: &str) -> (&str, &str) {
    let base_start = name.rfind('/').map_or(0, |i| i + 1);
    match name[base_start..].find('.') {
        Some(dot) => (&name[..base_start + dot], &name[base_start + dot + 1..]),
        None => (name, ""),
    }
}

/// What one header block says.
enum Header {
    /// Two zero blocks end the archive; one is enough to stop.
    End,
    /// A header whose data is more header (GNU long name `L`, pax `x`/`g`).
    Extension { kind: u8, size: u64 },
    Entry {
        name: String,
        size: u64,
        regular: bool,
    },
}

fn octal(field: &[u8]) -> Option<u64> {
    // GNU base-256 for sizes of 8 GiB and more.
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        let mut v: u64 = u64::from(field[0] & 0x7f);
        for b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(*b))?;
        }
        return Some(v);
    }
    let s: String = field
        .iter()
        .take_while(|b| **b != 0)
        .map(|b| *b as char)
        .collect();
    let s = s.trim();
    if s.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(s, 8).ok()
}

fn cstr(field: &[u8]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

fn parse_header(block: &[u8], offset: u64) -> Result<Header, TarError> {
    let bad = |detail: &str| TarError::BadHeader {
        offset,
        detail: detail.into(),
    };
    if block.iter().all(|b| *b == 0) {
        return Ok(Header::End);
    }
    let stored = octal(&block[148..156]).ok_or_else(|| bad("checksum is not a number"))?;
    let sum: u64 = block
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if (148..156).contains(&i) {
                32
            } else {
                u64::from(*b)
            }
        })
        .sum();
    if sum != stored {
        return Err(bad("checksum mismatch (not a tar file, or corrupt)"));
    }
    let size = octal(&block[124..136]).ok_or_else(|| bad("size is not a number"))?;
    let kind = block[156];
    if matches!(kind, b'L' | b'x' | b'g') {
        return Ok(Header::Extension { kind, size });
    }
    let mut name = cstr(&block[0..100]);
    if &block[257..262] == b"ustar" {
        let prefix = cstr(&block[345..500]);
        if !prefix.is_empty() {
            name = format!("{prefix}/{name}");
        }
    }
    Ok(Header::Entry {
        name,
        size,
        regular: matches!(kind, b'0' | 0 | b'7'),
    })
}

/// The `path` record of a pax extended header, if any.
fn pax_path(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    text.lines().find_map(|line| {
        let (_, record) = line.split_once(' ')?;
        record.strip_prefix("path=").map(str::to_string)
    })
}

/// Walks the members of a tar stream fed in pieces: headers are parsed, member data is only
/// skipped over, so a whole shard streams through in constant memory.
#[derive(Debug, Default)]
pub struct TarWalker {
    /// Stream offset of the first byte of `pending`.
    offset: u64,
    pending: Vec<u8>,
    /// Data bytes still to skip before the next header.
    skip: u64,
    /// A long-name/pax header read, waiting for its entry.
    long_name: Option<String>,
    first_header: Option<u64>,
    /// Extension header whose data is being collected: (kind, size).
    collecting: Option<(u8, u64)>,
    done: bool,
}

impl TarWalker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stream bytes consumed so far.
    pub fn position(&self) -> u64 {
        self.offset + self.pending.len() as u64
    }

    /// True once the end-of-archive block was seen.
    pub fn finished(&self) -> bool {
        self.done
    }

    /// Feeds the next bytes of the stream; returns the members whose headers they complete.
    pub fn feed(&mut self, mut data: &[u8]) -> Result<Vec<Member>, TarError> {
        let mut out = Vec::new();
        while !data.is_empty() && !self.done {
            if self.skip > 0 {
                let n = (self.skip.min(data.len() as u64)) as usize;
                self.skip -= n as u64;
                self.offset += n as u64;
                data = &data[n..];
                continue;
            }
            let want = match self.collecting {
                Some((_, size)) => (size.div_ceil(BLOCK) * BLOCK) as usize,
                None => BLOCK as usize,
            };
            let take = (want - self.pending.len()).min(data.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.pending.len() < want {
                break;
            }
            let block = std::mem::take(&mut self.pending);
            let at = self.offset;
            self.offset += block.len() as u64;
            if let Some((kind, size)) = self.collecting.take() {
                let body = &block[..size as usize];
                match kind {
                    b'L' => self.long_name = Some(cstr(body)),
                    b'x' => {
                        if let Some(p) = pax_path(body) {
                            self.long_name = Some(p);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match parse_header(&block, at)? {
                Header::End => self.done = true,
                Header::Extension { kind, size } => {
                    self.first_header.get_or_insert(at);
                    if size > 1 << 20 {
                        return Err(TarError::BadHeader {
                            offset: at,
                            detail: format!("extension header of {size} bytes"),
                        });
                    }
                    if size == 0 {
                        continue;
                    }
                    self.collecting = Some((kind, size));
                }
                Header::Entry {
                    name,
                    size,
                    regular,
                } => {
                    let header_offset = self.first_header.take().unwrap_or(at);
                    let name = self.long_name.take().unwrap_or(name);
                    // A crafted size near 2^64 must not wrap the stream arithmetic.
                    let fits = padded(size).filter(|p| self.offset.checked_add(*p).is_some());
                    let Some(skip) = fits else {
                        return Err(TarError::BadHeader {
                            offset: at,
                            detail: format!("member size {size} runs past the end of any stream"),
                        });
                    };
                    self.skip = skip;
                    if regular {
                        out.push(Member {
                            name,
                            header_offset,
                            data_offset: self.offset,
                            size,
                        });
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Groups consecutive members into samples and returns each sample's start offset, plus the
/// end of the last one: `starts[i]..starts[i + 1]` is sample `i`'s byte range.
#[derive(Debug, Default)]
pub struct SampleBounds {
    pub starts: Vec<u64>,
    last_key: Option<String>,
    end: u64,
}

impl SampleBounds {
    pub fn push(&mut self, member: &Member) {
        let key = member.sample_key();
        if self.last_key.as_deref() != Some(key) {
            self.starts.push(member.header_offset);
            self.last_key = Some(key.to_string());
        }
        self.end = member.end();
    }

    /// Drops the last sample when the stream ended inside it (`len` bytes were read).
    pub fn finish(mut self, len: u64) -> Vec<u64> {
        // The dropped sample's start is where the complete ones end.
        if self.end > len
            && let Some(start) = self.starts.pop()
        {
            self.end = start;
        }
        if !self.starts.is_empty() {
            self.starts.push(self.end);
        }
        self.starts
    }

    pub fn samples(&self) -> usize {
        self.starts.len()
    }
}

/// One sample's parts, from its byte range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleParts {
    /// WebDataset's `__key__`.
    pub key: String,
    /// The image member's data within the range.
    pub image: Range<usize>,
    /// JSON object: `caption` (from `.txt`), `label` (from `.cls`), the `.json` member's
    /// fields, other small text members by extension, and `__key__`.
    pub metadata: String,
}

/// Splits one sample's bytes (from its first header to the end of its last member) into the
/// image and the fields that travel with it.
pub fn split_sample(bytes: &[u8]) -> Result<SampleParts, TarError> {
    let mut walker = TarWalker::new();
    let members = walker.feed(bytes)?;
    let len = bytes.len() as u64;
    let mut fields = serde_json::Map::new();
    let mut image: Option<(usize, Range<usize>)> = None;
    let mut key = String::new();
    for m in &members {
        let end = m.data_offset + m.size;
        if end > len {
            return Err(TarError::Truncated {
                name: m.name.clone(),
                offset: m.data_offset,
                end,
                len,
            });
        }
        if key.is_empty() {
            key = m.sample_key().to_string();
        }
        let data = m.data_offset as usize..end as usize;
        let ext = m.extension().to_ascii_lowercase();
        if let Some(rank) = IMAGE_EXTENSIONS.iter().position(|e| *e == ext) {
            if image.as_ref().is_none_or(|(r, _)| rank < *r) {
                image = Some((rank, data));
            }
            continue;
        }
        if m.size > MAX_FIELD_BYTES {
            continue;
        }
        let text = String::from_utf8_lossy(&bytes[data]).into_owned();
        match ext.as_str() {
            "txt" | "caption" => {
                fields.insert("caption".into(), text.into());
            }
            "cls" | "label" => {
                let value = text
                    .trim()
                    .parse::<i64>()
                    .map_or_else(|_| text.trim().into(), serde_json::Value::from);
                fields.insert("label".into(), value);
            }
            "json" => match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(serde_json::Value::Object(obj)) => fields.extend(obj),
                Ok(other) => {
                    fields.insert("json".into(), other);
                }
                Err(_) => {
                    fields.insert("json".into(), text.into());
                }
            },
            _ => {
                fields.insert(ext, text.into());
            }
        }
    }
    let Some((_, image)) = image else {
        return Err(TarError::NoImage {
            members: members
                .iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    fields.insert("__key__".into(), key.clone().into());
    Ok(SampleParts {
        key,
        image,
        metadata: serde_json::Value::Object(fields).to_string(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal ustar writer for tests.
    pub fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, data) in members {
            let mut h = [0u8; 512];
            h[..name.len()].copy_from_slice(name.as_bytes());
            h[100..107].copy_from_slice(b"0000644");
            h[108..115].copy_from_slice(b"0000000");
            h[116..123].copy_from_slice(b"0000000");
            h[124..135].copy_from_slice(format!("{:011o}", data.len()).as_bytes());
            h[136..147].copy_from_slice(b"00000000000");
            h[156] = b'0';
            h[257..263].copy_from_slice(b"ustar\0");
            h[263..265].copy_from_slice(b"00");
            h[148..156].copy_from_slice(b"        ");
            let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
            h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
            out.extend_from_slice(&h);
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    fn shard() -> Vec<u8> {
        tar_of(&[
            ("d/000.jpg", b"IMG0"),
            ("d/000.txt", b"a cat"),
            ("d/000.cls", b"3"),
            ("d/001.png", &[7u8; 700]),
            ("d/001.json", br#"{"caption":"a dog","w":2}"#),
            ("d/002.jpg", b"IMG2"),
        ])
    }

    #[test]
    fn walks_members_fed_in_any_pieces() {
        let data = shard();
        for piece in [1, 7, 512, 513, 100_000] {
            let mut w = TarWalker::new();
            let mut bounds = SampleBounds::default();
            for chunk in data.chunks(piece) {
                for m in w.feed(chunk).unwrap() {
                    bounds.push(&m);
                }
            }
            assert!(w.finished());
            let starts = bounds.finish(data.len() as u64);
            assert_eq!(starts.len(), 4, "3 samples and the end");
            assert_eq!(starts[0], 0);
            let parts: Vec<SampleParts> = starts
                .windows(2)
                .map(|r| split_sample(&data[r[0] as usize..r[1] as usize]).unwrap())
                .collect();
            assert_eq!(parts[0].key, "d/000");
            assert_eq!(&data[starts[0] as usize..][parts[0].image.clone()], b"IMG0");
            let m0: serde_json::Value = serde_json::from_str(&parts[0].metadata).unwrap();
            assert_eq!(m0["caption"], "a cat");
            assert_eq!(m0["label"], 3);
            assert_eq!(m0["__key__"], "d/000");
            let m1: serde_json::Value = serde_json::from_str(&parts[1].metadata).unwrap();
            assert_eq!(m1["caption"], "a dog");
            assert_eq!(m1["w"], 2);
            assert_eq!(parts[1].image.len(), 700);
            assert_eq!(parts[2].key, "d/002");
        }
    }

    #[test]
    fn a_stream_cut_inside_a_sample_drops_that_sample_only() {
        let data = shard();
        let full = {
            let mut w = TarWalker::new();
            let mut b = SampleBounds::default();
            for m in w.feed(&data).unwrap() {
                b.push(&m);
            }
            b.finish(data.len() as u64)
        };
        let cut = (full[1] + 600) as usize; // inside sample 1's image
        let mut w = TarWalker::new();
        let mut b = SampleBounds::default();
        for m in w.feed(&data[..cut]).unwrap() {
            b.push(&m);
        }
        assert_eq!(b.finish(cut as u64), full[..2].to_vec());
        let err = split_sample(&data[full[1] as usize..cut]).unwrap_err();
        assert!(matches!(err, TarError::Truncated { .. }), "{err}");
    }

    /// Rewrites a header's checksum, so that a mutated header is parsed, not refused at once.
    fn reseal(block: &mut [u8]) {
        block[148..156].copy_from_slice(b"        ");
        let sum: u32 = block.iter().map(|b| u32::from(*b)).sum();
        block[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    }

    /// A GNU base-256 size field holding `size`.
    fn base256(size: u64) -> [u8; 12] {
        let mut field = [0u8; 12];
        field[0] = 0x80;
        field[4..].copy_from_slice(&size.to_be_bytes());
        field
    }

    #[test]
    fn a_size_near_2_pow_64_is_a_header_error_not_a_wrap() {
        let with_size = |size: u64| {
            let mut data = shard();
            data[124..136].copy_from_slice(&base256(size));
            reseal(&mut data[..512]);
            data
        };
        // Sizes whose padding or end does not fit in a u64: refused where they are read.
        for size in [u64::MAX, u64::MAX - 100, u64::MAX - 511] {
            let data = with_size(size);
            let err = TarWalker::new().feed(&data).unwrap_err();
            assert!(
                err.to_string().contains("tar header at byte 0"),
                "{size}: {err}"
            );
            let err = split_sample(&data).unwrap_err();
            assert!(matches!(err, TarError::BadHeader { .. }), "{size}: {err}");
        }
        // A size that fits but runs past the bytes: the sample is truncated, its walk skips it.
        let data = with_size(1 << 63);
        let err = split_sample(&data).unwrap_err();
        assert!(matches!(err, TarError::Truncated { .. }), "{err}");
        let mut bounds = SampleBounds::default();
        for m in TarWalker::new().feed(&data).unwrap() {
            bounds.push(&m);
        }
        assert!(
            bounds.finish(data.len() as u64).is_empty(),
            "no sample ends inside the data"
        );
    }

    /// xorshift64*: the fuzz loops' seeded source of bytes (no dependency, same run every time).
    pub struct Rng(pub u64);

    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        pub fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Mutates a real shard (bytes, header fields with resealed checksums, base-256 sizes,
    /// truncation) and walks each result in random pieces, then splits random ranges: whatever
    /// the bytes, an error, never a panic. `STOKER_FUZZ_ITERATIONS` runs longer.
    #[test]
    fn mutated_shards_give_errors_never_panics() {
        let iterations: usize = std::env::var("STOKER_FUZZ_ITERATIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200_000);
        let seeds = [
            shard(),
            tar_of(&[
                ("a/very/long/name.jpg", &[1u8; 1500]),
                ("a/very/long/name.txt", b"x"),
            ]),
        ];
        // Where each seed's headers are: mutations aim there most of the time.
        let headers: Vec<Vec<usize>> = seeds
            .iter()
            .map(|seed| {
                let members = TarWalker::new().feed(seed).unwrap();
                members
                    .iter()
                    .map(|m| m.data_offset as usize - 512)
                    .collect()
            })
            .collect();
        let mut rng = Rng(0x5EED_0F57_0CE2);
        for i in 0..iterations {
            let mut data = seeds[i % seeds.len()].clone();
            for _ in 0..=rng.below(4) {
                if data.len() < 512 {
                    break;
                }
                let known = &headers[i % seeds.len()];
                let header = match rng.below(5) {
                    0 => rng.below(data.len() / 512) * 512,
                    _ => known[rng.below(known.len())].min(data.len() - 512),
                };
                match rng.below(5) {
                    0 => {
                        let at = rng.below(data.len());
                        data[at] = rng.next() as u8;
                    }
                    1 => {
                        let field = 124 + rng.below(12);
                        data[header + field] = rng.next() as u8;
                        reseal(&mut data[header..header + 512]);
                    }
                    2 => {
                        // The values where arithmetic breaks, then any magnitude.
                        let size = base256(match rng.below(4) {
                            0 => u64::MAX - rng.below(2048) as u64,
                            1 => 1 << rng.below(64),
                            2 => rng.below(1 << 16) as u64,
                            _ => rng.next() >> rng.below(64),
                        });
                        data[header + 124..header + 136].copy_from_slice(&size);
                        reseal(&mut data[header..header + 512]);
                    }
                    3 => {
                        data[header + 156] = [b'L', b'x', b'g', b'5', 0][rng.below(5)];
                        reseal(&mut data[header..header + 512]);
                    }
                    _ => data.truncate(rng.below(data.len())),
                }
            }
            let mut walker = TarWalker::new();
            let piece = 1 + rng.below(1200);
            for chunk in data.chunks(piece) {
                let Ok(members) = walker.feed(chunk) else {
                    break;
                };
                for m in members {
                    assert!(m.end() >= m.data_offset + m.size, "{m:?}");
                }
            }
            let start = rng.below(data.len() + 1);
            let end = start + rng.below(data.len() - start + 1);
            if let Ok(parts) = split_sample(&data[start..end]) {
                let _ = &data[start..end][parts.image];
            }
        }
    }

    #[test]
    fn garbage_is_a_header_error_with_its_offset() {
        let err = TarWalker::new().feed(&[b'x'; 1024]).unwrap_err();
        assert_eq!(
            err.to_string().split(':').next(),
            Some("tar header at byte 0")
        );
        let no_image = tar_of(&[("k.txt", b"only text")]);
        assert!(matches!(
            split_sample(&no_image),
            Err(TarError::NoImage { .. })
        ));
    }
}
