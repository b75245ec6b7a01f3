//! PNG through the `image` crate (the `png` crate: measured faster than zune-png), WebP through
//! libwebp (the `image` crate's decoder for what libwebp refuses). Grayscale, 16-bit and alpha
//! are converted to RGB8; alpha is composited over white, the usual choice for transparent
//! logos and stickers in VLM data.

use std::io::Cursor;

use image::{ColorType, ImageDecoder, ImageError, Limits};

use super::{
    DecodeError, Decoded, Format, Orientation, Probe, png_exif_orientation, sniff::PNG_MAGIC,
};

fn classify(format: Format, err: ImageError) -> DecodeError {
    let detail = err.to_string();
    let eof = match &err {
        ImageError::IoError(io) => io.kind() == std::io::ErrorKind::UnexpectedEof,
        _ => false,
    } || detail.contains("unexpected end")
        || detail.contains("UnexpectedEof")
        || detail.contains("end of file")
        || detail.contains("EOF");
    match err {
        ImageError::Limits(_) => DecodeError::TooLarge {
            format,
            width: 0,
            height: 0,
            max_pixels: 0,
        },
        ImageError::Unsupported(_) => DecodeError::Unsupported {
            what: format.as_str(),
        },
        _ if eof => DecodeError::Truncated { format, detail },
        _ => DecodeError::Corrupt { format, detail },
    }
}

/// Reads the PNG IHDR by hand: the size must be checked before the decoder allocates anything.
fn png_ihdr_size(data: &[u8]) -> Result<(u32, u32), DecodeError> {
    if data.len() < 24 {
        return Err(DecodeError::Truncated {
            format: Format::Png,
            detail: "shorter than the IHDR chunk".into(),
        });
    }
    if &data[12..16] != b"IHDR" || !data.starts_with(PNG_MAGIC) {
        return Err(DecodeError::Corrupt {
            format: Format::Png,
            detail: "first chunk is not IHDR".into(),
        });
    }
    let w = u32::from_be_bytes([data[16], data[17], data[18], data[19]]);
    let h = u32::from_be_bytes([data[20], data[21], data[22], data[23]]);
    Ok((w, h))
}

pub(super) fn probe(format: Format, data: &[u8]) -> Result<Probe, DecodeError> {
    match format {
        Format::Png => {
            let (width, height) = png_ihdr_size(data)?;
            Ok(Probe {
                format,
                width,
                height,
                orientation: png_exif_orientation(data),
            })
        }
        _ => {
            // The WebP decoder reads only the RIFF/VP8 headers here.
            let mut dec = image::codecs::webp::WebPDecoder::new(Cursor::new(data))
                .map_err(|e| classify(format, e))?;
            let (width, height) = dec.dimensions();
            let orientation = dec
                .orientation()
                .map(orientation_from_image)
                .unwrap_or_default();
            Ok(Probe {
                format,
                width,
                height,
                orientation,
            })
        }
    }
}

fn orientation_from_image(o: image::metadata::Orientation) -> Orientation {
    use image::metadata::Orientation as O;
    match o {
        O::NoTransforms => Orientation::Normal,
        O::FlipHorizontal => Orientation::FlipH,
        O::Rotate180 => Orientation::Rotate180,
        O::FlipVertical => Orientation::FlipV,
        O::Rotate90FlipH => Orientation::Transpose,
        O::Rotate90 => Orientation::Rotate90,
        O::Rotate270FlipH => Orientation::Transverse,
        O::Rotate270 => Orientation::Rotate270,
    }
}

pub(super) fn decode(
    format: Format,
    data: &[u8],
    out: &mut Vec<u8>,
) -> Result<Decoded, DecodeError> {
    match format {
        Format::Png => {
            let mut limits = Limits::default();
            // Second line of defence behind the header check: caps every allocation.
            limits.max_alloc = Some(1 << 30);
            let dec = image::codecs::png::PngDecoder::with_limits(Cursor::new(data), limits)
                .map_err(|e| classify(format, e))?;
            read_rgb8(format, dec, out)
        }
        _ => match decode_webp_libwebp(data, out) {
            Some(decoded) => Ok(decoded),
            // Animations and anything libwebp refuses: the `image` crate decodes the first
            // frame, or says precisely why not (truncated or corrupt).
            None => {
                let dec = image::codecs::webp::WebPDecoder::new(Cursor::new(data))
                    .map_err(|e| classify(format, e))?;
                read_rgb8(format, dec, out)
            }
        },
    }
}

/// A still WebP through libwebp, straight into `out` (measured 2.5x faster than the `image`
/// crate's decoder on the benchmark's lossy photos); `None` when libwebp cannot decode it.
fn decode_webp_libwebp(data: &[u8], out: &mut Vec<u8>) -> Option<Decoded> {
    use libwebp_sys as webp;
    // SAFETY: an all-zero WebPBitstreamFeatures is a valid value (plain integers).
    let mut f: webp::WebPBitstreamFeatures = unsafe { std::mem::zeroed() };
    // SAFETY: `data` is valid for its length; `f` is a live, writable struct.
    let status = unsafe { webp::WebPGetFeatures(data.as_ptr(), data.len(), &mut f) };
    if status != webp::VP8StatusCode::VP8_STATUS_OK || f.has_animation != 0 {
        return None;
    }
    let (w, h) = (u32::try_from(f.width).ok()?, u32::try_from(f.height).ok()?);
    // The size was checked against the limit by `probe` (the `image` crate's header parse);
    // decode nothing that disagrees with it.
    let probed = image::codecs::webp::WebPDecoder::new(Cursor::new(data))
        .ok()?
        .dimensions();
    if probed != (w, h) || w == 0 || h == 0 {
        return None;
    }
    let (wu, hu) = (w as usize, h as usize);
    let need = wu * hu * 3;
    if out.len() < need {
        out.resize(need, 0);
    }
    if f.has_alpha == 0 {
        // SAFETY: `out` holds `need` = stride x height bytes, all written by libwebp.
        let p = unsafe {
            webp::WebPDecodeRGBInto(
                data.as_ptr(),
                data.len(),
                out.as_mut_ptr(),
                need,
                (wu * 3) as libc::c_int,
            )
        };
        if p.is_null() {
            return None;
        }
    } else {
        let mut rgba = vec![0u8; wu * hu * 4];
        // SAFETY: `rgba` holds stride x height bytes.
        let p = unsafe {
            webp::WebPDecodeRGBAInto(
                data.as_ptr(),
                data.len(),
                rgba.as_mut_ptr(),
                rgba.len(),
                (wu * 4) as libc::c_int,
            )
        };
        if p.is_null() {
            return None;
        }
        to_rgb(&rgba, 4, &mut out[..need]);
    }
    Some(Decoded::whole(w, h))
}

fn read_rgb8(
    format: Format,
    dec: impl ImageDecoder,
    out: &mut Vec<u8>,
) -> Result<Decoded, DecodeError> {
    let (w, h) = dec.dimensions();
    let color = dec.color_type();
    let need = w as usize * h as usize * 3;
    // Grown, never cleared: the decoder overwrites every byte it is given.
    if out.len() < need {
        out.resize(need, 0);
    }
    let out = &mut out[..need];
    if color == ColorType::Rgb8 {
        // The common case decodes straight into the caller's buffer.
        dec.read_image(out).map_err(|e| classify(format, e))?;
        return Ok(Decoded::whole(w, h));
    }
    let mut raw = vec![0u8; dec.total_bytes() as usize];
    dec.read_image(&mut raw).map_err(|e| classify(format, e))?;
    // 16-bit samples are big-endian in PNG but the decoder returns native u16; take the high
    // byte of each native value.
    let u16s = |raw: &[u8]| -> Vec<u8> {
        raw.chunks_exact(2)
            .map(|c| (u16::from_ne_bytes([c[0], c[1]]) >> 8) as u8)
            .collect()
    };
    let (bytes, channels): (std::borrow::Cow<'_, [u8]>, usize) = match color {
        ColorType::L8 => (raw.as_slice().into(), 1),
        ColorType::La8 => (raw.as_slice().into(), 2),
        ColorType::Rgba8 => (raw.as_slice().into(), 4),
        ColorType::L16 => (u16s(&raw).into(), 1),
        ColorType::La16 => (u16s(&raw).into(), 2),
        ColorType::Rgb16 => (u16s(&raw).into(), 3),
        ColorType::Rgba16 => (u16s(&raw).into(), 4),
        _ => {
            return Err(DecodeError::Unsupported { what: "color type" });
        }
    };
    to_rgb(&bytes, channels, out);
    Ok(Decoded::whole(w, h))
}

/// Packed gray, gray+alpha, RGB or RGBA (`channels` 1 to 4) to RGB8 in `out`, alpha composited
/// over white.
fn to_rgb(src: &[u8], channels: usize, out: &mut [u8]) {
    for (px, o) in src.chunks_exact(channels).zip(out.chunks_exact_mut(3)) {
        let (r, g, b, a) = match channels {
            1 => (px[0], px[0], px[0], 255),
            2 => (px[0], px[0], px[0], px[1]),
            3 => (px[0], px[1], px[2], 255),
            _ => (px[0], px[1], px[2], px[3]),
        };
        o.copy_from_slice(&[over_white(r, a), over_white(g, a), over_white(b, a)]);
    }
}

fn over_white(c: u8, a: u8) -> u8 {
    let (c, a) = (u32::from(c), u32::from(a));
    ((c * a + 255 * (255 - a) + 127) / 255) as u8
}
