//! JPEG through libjpeg-turbo 3 (vendored by the `turbojpeg` crate), with DCT-domain scaling.

use std::cell::RefCell;

use turbojpeg::{Colorspace, Decompressor, Image, PixelFormat, ScalingFactor};

use super::{DecodeError, Decoded, Format, Probe, dct_denominator, exif_orientation};

thread_local! {
    // One decompressor per pool thread: creating one costs an allocation of libjpeg state.
    static DECOMPRESSOR: RefCell<Option<Decompressor>> = const { RefCell::new(None) };
}

fn with_decompressor<T>(
    f: impl FnOnce(&mut Decompressor) -> Result<T, DecodeError>,
) -> Result<T, DecodeError> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Decompressor::new().map_err(|e| corrupt(&e))?);
        }
        let result = match slot.as_mut() {
            Some(d) => f(d),
            None => Err(DecodeError::Corrupt {
                format: Format::Jpeg,
                detail: "no decompressor".into(),
            }),
        };
        // A failed decompression can leave the handle's state (warning flag, partial
        // decode) behind and fail the next good image; start afresh after any error.
        if result.is_err() {
            *slot = None;
        }
        result
    })
}

/// A short file shows as libjpeg's warning "Premature end of JPEG file" (TurboJPEG turns
/// warnings into errors), but a cut inside the scan can surface first as "Corrupt JPEG data";
/// so a failure on data that does not end with the EOI marker counts as truncated.
fn classify(err: &turbojpeg::Error, data: &[u8]) -> DecodeError {
    let detail = err.to_string();
    if detail.contains("Premature end of JPEG file") || !ends_with_eoi(data) {
        DecodeError::Truncated {
            format: Format::Jpeg,
            detail,
        }
    } else {
        DecodeError::Corrupt {
            format: Format::Jpeg,
            detail,
        }
    }
}

/// Whether the data ends with the EOI marker (FF D9), ignoring trailing padding.
fn ends_with_eoi(data: &[u8]) -> bool {
    let end = data
        .iter()
        .rposition(|&b| b != 0 && !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    end >= 2 && data[end - 2] == 0xFF && data[end - 1] == 0xD9
}

fn corrupt(err: &turbojpeg::Error) -> DecodeError {
    DecodeError::Corrupt {
        format: Format::Jpeg,
        detail: err.to_string(),
    }
}

pub(super) fn probe(data: &[u8]) -> Result<Probe, DecodeError> {
    let header = with_decompressor(|d| d.read_header(data).map_err(|e| classify(&e, data)))?;
    let width = u32::try_from(header.width).map_err(|_| DecodeError::Corrupt {
        format: Format::Jpeg,
        detail: "width overflow".into(),
    })?;
    let height = u32::try_from(header.height).map_err(|_| DecodeError::Corrupt {
        format: Format::Jpeg,
        detail: "height overflow".into(),
    })?;
    Ok(Probe {
        format: Format::Jpeg,
        width,
        height,
        orientation: exif_orientation(data),
    })
}

pub(super) fn decode(
    data: &[u8],
    probe: &Probe,
    min_size: Option<(u32, u32)>,
    out: &mut Vec<u8>,
) -> Result<Decoded, DecodeError> {
    with_decompressor(|d| {
        let header = d.read_header(data).map_err(|e| classify(&e, data))?;
        // Power-of-two factors only: on this path libjpeg-turbo's SIMD IDCTs apply; the
        // 5/8..7/8 kernels are plain C and measured slower overall.
        let denom = match min_size {
            // Lossless JPEGs cannot be scaled in the DCT domain.
            Some((mw, mh)) if !header.is_lossless => {
                dct_denominator(probe.width, probe.height, mw, mh)
            }
            _ => 1,
        };
        let factor = if denom == 1 {
            ScalingFactor::ONE
        } else {
            ScalingFactor::new(1, denom as usize)
        };
        d.set_scaling_factor(factor).map_err(|e| corrupt(&e))?;
        let scaled = header.scaled(factor);
        let (w, h) = (scaled.width, scaled.height);
        // libjpeg cannot convert CMYK/YCCK to RGB itself: decode CMYK and convert below.
        let cmyk = matches!(header.colorspace, Colorspace::CMYK | Colorspace::YCCK);
        let (format, channels) = if cmyk {
            (PixelFormat::CMYK, 4)
        } else {
            (PixelFormat::RGB, 3)
        };
        out.clear();
        out.resize(w * h * channels, 0);
        let image = Image {
            pixels: out.as_mut_slice(),
            width: w,
            pitch: w * channels,
            height: h,
            format,
        };
        d.decompress(data, image).map_err(|e| classify(&e, data))?;
        if cmyk {
            cmyk_to_rgb_in_place(out);
        }
        Ok(Decoded {
            width: w as u32,
            height: h as u32,
        })
    })
}

/// CMYK JPEGs (Adobe) store inverted ink values, so R = C·K/255 and so on; the buffer shrinks
/// from 4 to 3 bytes per pixel in place.
fn cmyk_to_rgb_in_place(buf: &mut Vec<u8>) {
    let n = buf.len() / 4;
    for i in 0..n {
        let (c, m, y, k) = (
            u32::from(buf[i * 4]),
            u32::from(buf[i * 4 + 1]),
            u32::from(buf[i * 4 + 2]),
            u32::from(buf[i * 4 + 3]),
        );
        buf[i * 3] = (c * k / 255) as u8;
        buf[i * 3 + 1] = (m * k / 255) as u8;
        buf[i * 3 + 2] = (y * k / 255) as u8;
    }
    buf.truncate(n * 3);
}
