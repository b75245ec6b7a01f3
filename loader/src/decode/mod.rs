//! Decoding encoded images into RGB8: format sniffing, header probing with a pixel-count guard
//! (checked before any pixel buffer is allocated), JPEG through libjpeg-turbo with DCT-domain
//! scaling, PNG and WebP through the `image` crate, EXIF orientation, and the skip reasons.

mod jpeg;
mod orientation;
mod raster;
mod sniff;

pub use orientation::{
    Orientation, Rect, apply_orientation, exif_orientation, png_exif_orientation,
};
pub use sniff::{Format, sniff};

/// Why a sample was skipped. The string form is the `reason` label on metrics and the
/// `skip_reason` in replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// The bytes claim a known format but do not decode (bad marker, checksum, Huffman data).
    Corrupt,
    /// The data ends before the image does.
    Truncated,
    /// Not an image format the loader decodes (HTML error page, text, GIF, ...).
    Unsupported,
    /// The header announces more pixels than the configured limit (decompression bomb guard).
    TooLarge,
    /// The object does not exist (S3 404).
    NotFound,
    /// A zero-byte object.
    Empty,
    /// S3 kept failing after all retries (throttling, 5xx, network): the sample is fine, so the
    /// sidecar decodes its batch again later rather than deliver it without the sample.
    S3Error,
    /// S3 refused access (401/403, expired credentials) or the bucket is gone: no retry helps;
    /// the sidecar stops delivery with `source_unavailable` instead of sending empty batches.
    SourceUnavailable,
    /// The transform cannot produce an output for this image (e.g. extreme aspect ratio).
    BadGeometry,
}

impl SkipReason {
    pub const ALL: [SkipReason; 9] = [
        SkipReason::Corrupt,
        SkipReason::Truncated,
        SkipReason::Unsupported,
        SkipReason::TooLarge,
        SkipReason::NotFound,
        SkipReason::Empty,
        SkipReason::S3Error,
        SkipReason::SourceUnavailable,
        SkipReason::BadGeometry,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Corrupt => "corrupt",
            SkipReason::Truncated => "truncated",
            SkipReason::Unsupported => "unsupported",
            SkipReason::TooLarge => "too_large",
            SkipReason::NotFound => "not_found",
            SkipReason::Empty => "empty",
            SkipReason::S3Error => "s3_error",
            SkipReason::SourceUnavailable => "source_unavailable",
            SkipReason::BadGeometry => "bad_geometry",
        }
    }

    pub fn parse(s: &str) -> Option<SkipReason> {
        SkipReason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A decode failure. Messages carry the decoder's words; the key is added by the caller.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("empty object")]
    Empty,
    #[error("unsupported format ({what})")]
    Unsupported { what: &'static str },
    #[error("{format:?} image of {width}x{height} exceeds the limit of {max_pixels} pixels")]
    TooLarge {
        format: Format,
        width: u64,
        height: u64,
        max_pixels: u64,
    },
    #[error("{format:?} data ends early: {detail}")]
    Truncated { format: Format, detail: String },
    #[error("{format:?} data is corrupt: {detail}")]
    Corrupt { format: Format, detail: String },
}

impl DecodeError {
    /// The skip reason, also the error label on metrics.
    pub fn category(&self) -> SkipReason {
        match self {
            DecodeError::Empty => SkipReason::Empty,
            DecodeError::Unsupported { .. } => SkipReason::Unsupported,
            DecodeError::TooLarge { .. } => SkipReason::TooLarge,
            DecodeError::Truncated { .. } => SkipReason::Truncated,
            DecodeError::Corrupt { .. } => SkipReason::Corrupt,
        }
    }
}

/// Limits applied before decoding.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    /// Largest width x height accepted, read from the header before allocating.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        // 64 MP: above any camera photo in a training set, well below a bomb's 3.6 GP.
        Self {
            max_pixels: 64 * 1024 * 1024,
        }
    }
}

/// What the header says, before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub format: Format,
    /// Stored size, before orientation.
    pub width: u32,
    pub height: u32,
    pub orientation: Orientation,
}

impl Probe {
    /// Size after EXIF orientation: what a viewer shows and what the transform targets.
    pub fn oriented_size(&self) -> (u32, u32) {
        if self.orientation.swaps_axes() {
            (self.height, self.width)
        } else {
            (self.width, self.height)
        }
    }
}

/// Reads the header: format, size and orientation. Cheap; allocates no pixel buffer.
pub fn probe(data: &[u8], limits: &DecodeLimits) -> Result<Probe, DecodeError> {
    if data.is_empty() {
        return Err(DecodeError::Empty);
    }
    let format = sniff(data).ok_or(DecodeError::Unsupported {
        what: sniff::describe_unknown(data),
    })?;
    let probe = match format {
        Format::Jpeg => jpeg::probe(data)?,
        Format::Png | Format::WebP => raster::probe(format, data)?,
    };
    let pixels = u64::from(probe.width) * u64::from(probe.height);
    if pixels > limits.max_pixels || probe.width == 0 || probe.height == 0 {
        if pixels == 0 {
            return Err(DecodeError::Corrupt {
                format,
                detail: "zero width or height".into(),
            });
        }
        return Err(DecodeError::TooLarge {
            format,
            width: probe.width.into(),
            height: probe.height.into(),
            max_pixels: limits.max_pixels,
        });
    }
    Ok(probe)
}

/// An RGB8 image decoded into a caller-owned buffer, in stored (not yet oriented) order: the
/// `width` x `height` pixels at (`x`, `y`) of the image decoded at `full_width` x
/// `full_height` (its DCT-scaled size). Only JPEGs asked for a region decode less than all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub width: u32,
    pub height: u32,
    pub full_width: u32,
    pub full_height: u32,
    pub x: u32,
    pub y: u32,
}

impl Decoded {
    /// The whole image, `width` x `height`.
    pub fn whole(width: u32, height: u32) -> Self {
        Self {
            width,
            height,
            full_width: width,
            full_height: height,
            x: 0,
            y: 0,
        }
    }

    /// Bytes of the decoded pixels (RGB8), at the front of the output buffer.
    pub fn byte_len(&self) -> usize {
        self.width as usize * self.height as usize * 3
    }

    /// Where the decoded pixels sit in the full image.
    pub fn rect(&self) -> Rect {
        Rect {
            x: self.x,
            y: self.y,
            width: self.width,
            height: self.height,
        }
    }
}

/// Decodes `data` (already probed) to packed RGB8 at the front of `out`: its first
/// [`Decoded::byte_len`] bytes. `out` is reused across calls: grown when too small, never
/// shrunk nor cleared, so a decode writes its pixels without zeroing them first. For JPEG, `min_size` (stored orientation) lets libjpeg-turbo decode at
/// 1/2, 1/4 or 1/8 scale in the DCT domain as long as the result stays at least that large,
/// and `region` (stored orientation, full-resolution pixels) the part the caller reads: only it
/// is decoded, widened to libjpeg-turbo's alignment. Other formats decode whole.
pub fn decode_rgb(
    data: &[u8],
    probe: &Probe,
    min_size: Option<(u32, u32)>,
    region: Option<Rect>,
    out: &mut Vec<u8>,
) -> Result<Decoded, DecodeError> {
    match probe.format {
        Format::Jpeg => jpeg::decode(data, probe, min_size, region, out),
        Format::Png | Format::WebP => raster::decode(probe.format, data, out),
    }
}

/// The DCT scale denominator (1, 2, 4 or 8) for a `width` x `height` JPEG that must stay at least
/// `min_w` x `min_h`: the source must be at least twice the target before scaling kicks in.
pub fn dct_denominator(width: u32, height: u32, min_w: u32, min_h: u32) -> u32 {
    for d in [8u32, 4, 2] {
        if width.div_ceil(d) >= min_w.max(1) && height.div_ceil(d) >= min_h.max(1) {
            return d;
        }
    }
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dct_scale_only_when_twice_the_target() {
        assert_eq!(dct_denominator(1600, 1200, 448, 448), 2);
        assert_eq!(dct_denominator(894, 894, 448, 448), 1);
        assert_eq!(dct_denominator(4000, 3000, 448, 448), 4);
        assert_eq!(dct_denominator(500, 375, 448, 448), 1);
        assert_eq!(dct_denominator(8000, 8000, 448, 448), 8);
    }

    #[test]
    fn skip_reasons_round_trip() {
        for r in SkipReason::ALL {
            assert_eq!(SkipReason::parse(r.as_str()), Some(r));
        }
    }
}
