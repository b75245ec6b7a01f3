//! JPEG through libjpeg-turbo 3 (vendored by the `turbojpeg` crate), with DCT-domain scaling and
//! partial decompression of a cropping region. The TurboJPEG calls go through `turbojpeg::raw`
//! (the `turbojpeg-sys` bindings): the safe crate does not expose `tj3SetCroppingRegion`.

use std::cell::RefCell;
use std::ffi::CStr;

use turbojpeg::raw;

use super::{DecodeError, Decoded, Format, Probe, Rect, dct_denominator, exif_orientation};

/// One TurboJPEG decompression instance.
struct Decompressor {
    handle: raw::tjhandle,
}

/// What `tj3DecompressHeader` read.
struct Header {
    width: u32,
    height: u32,
    /// `TJSAMP_*`; unknown for unusual sampling factors (no cropping then).
    subsamp: i32,
    lossless: bool,
    cmyk: bool,
}

impl Decompressor {
    fn new() -> Result<Self, DecodeError> {
        // SAFETY: tj3Init has no preconditions; a null handle is checked below.
        let handle = unsafe { raw::tj3Init(raw::TJINIT_TJINIT_DECOMPRESS as libc::c_int) };
        if handle.is_null() {
            return Err(DecodeError::Corrupt {
                format: Format::Jpeg,
                detail: "cannot create a TurboJPEG decompressor".into(),
            });
        }
        Ok(Self { handle })
    }

    fn error(&self) -> String {
        // SAFETY: the handle is live; tj3GetErrorStr returns a NUL-terminated string it owns.
        let msg = unsafe { CStr::from_ptr(raw::tj3GetErrorStr(self.handle)) };
        msg.to_string_lossy().into_owned()
    }

    fn check(&self, rc: libc::c_int) -> Result<(), String> {
        if rc == 0 { Ok(()) } else { Err(self.error()) }
    }

    fn get(&self, param: raw::TJPARAM) -> libc::c_int {
        // SAFETY: the handle is live; tj3Get only reads its state.
        unsafe { raw::tj3Get(self.handle, param as libc::c_int) }
    }

    fn read_header(&mut self, data: &[u8]) -> Result<Header, String> {
        // SAFETY: the handle is live and `data` is valid for `data.len()` bytes.
        let rc = unsafe {
            raw::tj3DecompressHeader(self.handle, data.as_ptr(), data.len() as raw::size_t)
        };
        self.check(rc)?;
        let (width, height) = (
            self.get(raw::TJPARAM_TJPARAM_JPEGWIDTH),
            self.get(raw::TJPARAM_TJPARAM_JPEGHEIGHT),
        );
        let colorspace = self.get(raw::TJPARAM_TJPARAM_COLORSPACE);
        Ok(Header {
            width: u32::try_from(width).map_err(|_| format!("width {width}"))?,
            height: u32::try_from(height).map_err(|_| format!("height {height}"))?,
            subsamp: self.get(raw::TJPARAM_TJPARAM_SUBSAMP),
            lossless: self.get(raw::TJPARAM_TJPARAM_LOSSLESS) != 0,
            cmyk: colorspace == raw::TJCS_TJCS_CMYK as libc::c_int
                || colorspace == raw::TJCS_TJCS_YCCK as libc::c_int,
        })
    }

    fn set_scaling(&mut self, denom: u32) -> Result<(), String> {
        let factor = raw::tjscalingfactor {
            num: 1,
            denom: denom as libc::c_int,
        };
        // SAFETY: the handle is live.
        self.check(unsafe { raw::tj3SetScalingFactor(self.handle, factor) })
    }

    /// `None` decodes the whole (scaled) image. The region is relative to the scaled image and
    /// its `x` a multiple of the scaled iMCU width; both are checked by libjpeg-turbo.
    fn set_cropping(&mut self, region: Option<Rect>) -> Result<(), String> {
        let r = region.map_or(
            raw::tjregion {
                x: 0,
                y: 0,
                w: 0,
                h: 0,
            },
            |r| raw::tjregion {
                x: r.x as libc::c_int,
                y: r.y as libc::c_int,
                w: r.width as libc::c_int,
                h: r.height as libc::c_int,
            },
        );
        // SAFETY: the handle is live and a header has been read (required for a region).
        self.check(unsafe { raw::tj3SetCroppingRegion(self.handle, r) })
    }

    fn decompress(
        &mut self,
        data: &[u8],
        out: &mut [u8],
        pitch: usize,
        format: raw::TJPF,
    ) -> Result<(), String> {
        // SAFETY: the handle is live, `data` is valid for its length, and `out` holds
        // `pitch` x the output height (the caller sized it from the same scale and region).
        let rc = unsafe {
            raw::tj3Decompress8(
                self.handle,
                data.as_ptr(),
                data.len() as raw::size_t,
                out.as_mut_ptr(),
                pitch as libc::c_int,
                format,
            )
        };
        self.check(rc)
    }
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed once.
        unsafe { raw::tj3Destroy(self.handle) }
    }
}

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
            *slot = Some(Decompressor::new()?);
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
fn classify(detail: String, data: &[u8]) -> DecodeError {
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

pub(super) fn probe(data: &[u8]) -> Result<Probe, DecodeError> {
    let header = with_decompressor(|d| d.read_header(data).map_err(|e| classify(e, data)))?;
    Ok(Probe {
        format: Format::Jpeg,
        width: header.width,
        height: header.height,
        orientation: exif_orientation(data),
    })
}

/// The iMCU width of a subsampling level at 1/`denom` scale (TurboJPEG's `TJSCALED` of
/// `tjMCUWidth`); `None` when the level is unknown.
fn scaled_mcu_width(subsamp: i32, denom: u32) -> Option<u32> {
    // turbojpeg.h's `tjMCUWidth`, indexed by TJSAMP (444, 422, 420, GRAY, 440, 411, 441): a
    // `static const` in the header, so not a symbol the library exports.
    const MCU_WIDTH: [u32; 7] = [8, 16, 16, 8, 8, 32, 8];
    let mcu = MCU_WIDTH.get(usize::try_from(subsamp).ok()?)?;
    Some(mcu.div_ceil(denom))
}

/// The region to decode, in pixels of the `sw` x `sh` image scaled by 1/`denom`: `region`
/// (full-resolution pixels) scaled, one pixel wider on each side for rounding, and its left
/// edge moved down to the scaled iMCU width as libjpeg-turbo requires. `None` when it would
/// cover the whole image anyway.
pub(super) fn scaled_region(
    region: Rect,
    denom: u32,
    mcu: u32,
    (sw, sh): (u32, u32),
) -> Option<Rect> {
    let x0 = (region.x / denom).saturating_sub(1);
    let y0 = (region.y / denom).saturating_sub(1);
    let x1 = ((region.x + region.width).div_ceil(denom) + 1).min(sw);
    let y1 = ((region.y + region.height).div_ceil(denom) + 1).min(sh);
    let x0 = x0 - x0 % mcu.max(1);
    Rect::part_of((x0, y0), (x1, y1), (sw, sh))
}

pub(super) fn decode(
    data: &[u8],
    probe: &Probe,
    min_size: Option<(u32, u32)>,
    region: Option<Rect>,
    out: &mut Vec<u8>,
) -> Result<Decoded, DecodeError> {
    with_decompressor(|d| {
        let header = d.read_header(data).map_err(|e| classify(e, data))?;
        // Power-of-two factors only: on this path libjpeg-turbo's SIMD IDCTs apply; the
        // 5/8..7/8 kernels are plain C and measured slower overall.
        let denom = match min_size {
            // Lossless JPEGs cannot be scaled in the DCT domain (nor cropped).
            Some((mw, mh)) if !header.lossless => {
                dct_denominator(probe.width, probe.height, mw, mh)
            }
            _ => 1,
        };
        d.set_scaling(denom).map_err(|e| classify(e, data))?;
        let full = (header.width.div_ceil(denom), header.height.div_ceil(denom));
        let mut window = region
            .filter(|_| !header.lossless)
            .and_then(|r| scaled_region(r, denom, scaled_mcu_width(header.subsamp, denom)?, full));
        // A region libjpeg-turbo refuses (it has the last word on alignment) costs only the
        // saving: decode the whole image.
        if d.set_cropping(window).is_err() {
            window = None;
            d.set_cropping(None).map_err(|e| classify(e, data))?;
        }
        let window = window.unwrap_or(Rect {
            x: 0,
            y: 0,
            width: full.0,
            height: full.1,
        });
        // libjpeg cannot convert CMYK/YCCK to RGB itself: decode CMYK and convert below.
        let (format, channels) = if header.cmyk {
            (raw::TJPF_TJPF_CMYK, 4)
        } else {
            (raw::TJPF_TJPF_RGB, 3)
        };
        let (w, h) = (window.width as usize, window.height as usize);
        let need = w * h * channels;
        // libjpeg-turbo writes every byte: grow the reused buffer, never zero what it holds.
        if out.len() < need {
            out.resize(need, 0);
        }
        d.decompress(data, &mut out[..need], w * channels, format)
            .map_err(|e| classify(e, data))?;
        if header.cmyk {
            cmyk_to_rgb_in_place(&mut out[..need]);
        }
        Ok(Decoded {
            width: window.width,
            height: window.height,
            full_width: full.0,
            full_height: full.1,
            x: window.x,
            y: window.y,
        })
    })
}

/// CMYK JPEGs (Adobe) store inverted ink values, so R = C·K/255 and so on; the pixels move
/// from 4 to 3 bytes each, in place, to the front of the buffer.
fn cmyk_to_rgb_in_place(buf: &mut [u8]) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_is_scaled_widened_and_aligned() {
        let r = Rect {
            x: 200,
            y: 0,
            width: 1200,
            height: 1200,
        };
        // 1600x1200 at 1/2 with 4:2:0 (iMCU 16 -> 8): x 100 - 1 = 99 -> 96.
        assert_eq!(
            scaled_region(r, 2, 8, (800, 600)),
            Some(Rect {
                x: 96,
                y: 0,
                width: 605,
                height: 600
            })
        );
        // The whole image: no region.
        let all = Rect {
            x: 0,
            y: 0,
            width: 500,
            height: 375,
        };
        assert_eq!(scaled_region(all, 1, 16, (500, 375)), None);
    }
}
