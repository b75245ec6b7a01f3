//! Resize modes, pure: sizes in, sizes out, and a resize of RGB8 pixels into a caller's slice.
//!
//! - `crop`: shorter side to the target, center crop (the torchvision Resize + CenterCrop pair).
//! - `fit`: the whole image inside the target, centered and padded (letterbox).
//! - `qwenSmart`: Qwen-VL dynamic resolution (`smart_resize` of Qwen2-VL / Qwen2.5-VL / Qwen3-VL):
//!   both sides multiples of `factor`, pixel count within [min_pixels, max_pixels], aspect kept.
//!   Output sizes differ per image, so batches are ragged.
//!
//! Output is uint8 HWC RGB; normalization belongs on the GPU.

use fast_image_resize::images::{CroppedImageMut, Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use stoker_contract::{ResizeMode, TransformArgs};

use crate::decode::Rect;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    Crop {
        width: u32,
        height: u32,
    },
    Fit {
        width: u32,
        height: u32,
        /// Gray level of the padding.
        pad: u8,
    },
    QwenSmart {
        factor: u32,
        min_pixels: u64,
        max_pixels: u64,
    },
}

impl Transform {
    /// Qwen2.5-VL's defaults: 14-pixel patches merged 2x2, 4 to 16384 merged tokens.
    pub const QWEN25_VL: Transform = Transform::QwenSmart {
        factor: 28,
        min_pixels: 4 * 28 * 28,
        max_pixels: 16384 * 28 * 28,
    };

    /// The transform the contract's flags name (the loader's `--resize ...` and the wire's),
    /// checked.
    pub fn from_args(a: &TransformArgs) -> Result<Self, TransformError> {
        let t = match a.resize {
            ResizeMode::Crop => Transform::Crop {
                width: a.width,
                height: a.height,
            },
            ResizeMode::Fit => Transform::Fit {
                width: a.width,
                height: a.height,
                pad: a.pad,
            },
            ResizeMode::QwenSmart => Transform::QwenSmart {
                factor: a.factor,
                min_pixels: a.min_pixels,
                max_pixels: a.max_pixels,
            },
        };
        t.validate()?;
        Ok(t)
    }

    /// The contract's flags for this transform; fields the mode does not use are zero.
    pub fn to_args(&self) -> TransformArgs {
        let unused = TransformArgs {
            resize: ResizeMode::Crop,
            width: 0,
            height: 0,
            pad: 0,
            factor: 0,
            min_pixels: 0,
            max_pixels: 0,
        };
        match *self {
            Transform::Crop { width, height } => TransformArgs {
                width,
                height,
                ..unused
            },
            Transform::Fit { width, height, pad } => TransformArgs {
                resize: ResizeMode::Fit,
                width,
                height,
                pad,
                ..unused
            },
            Transform::QwenSmart {
                factor,
                min_pixels,
                max_pixels,
            } => TransformArgs {
                resize: ResizeMode::QwenSmart,
                factor,
                min_pixels,
                max_pixels,
                ..unused
            },
        }
    }

    /// The mode's one spelling (`crop`, `fit`, `qwenSmart`).
    pub fn name(&self) -> &'static str {
        self.to_args().resize.as_str()
    }

    /// Rejects settings that cannot produce an image.
    pub fn validate(&self) -> Result<(), TransformError> {
        match *self {
            Transform::Crop { width, height } | Transform::Fit { width, height, .. } => {
                if width == 0
                    || height == 0
                    || u64::from(width) * u64::from(height) > MAX_OUTPUT_PIXELS
                {
                    return Err(TransformError::InvalidSettings {
                        detail: format!(
                            "target {width}x{height} must be 1..={MAX_OUTPUT_PIXELS} pixels"
                        ),
                    });
                }
            }
            Transform::QwenSmart {
                factor,
                min_pixels,
                max_pixels,
            } => {
                if factor == 0
                    || min_pixels > max_pixels
                    || max_pixels < u64::from(factor) * u64::from(factor)
                    || max_pixels > MAX_OUTPUT_PIXELS
                {
                    return Err(TransformError::InvalidSettings {
                        detail: format!(
                            "qwenSmart factor {factor}, pixels {min_pixels}..{max_pixels}: need factor > 0, min <= max, factor^2 <= max <= {MAX_OUTPUT_PIXELS}"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Output (width, height) for an image of `w` x `h` (after orientation).
    pub fn output_size(&self, w: u32, h: u32) -> Result<(u32, u32), TransformError> {
        match *self {
            Transform::Crop { width, height } | Transform::Fit { width, height, .. } => {
                Ok((width, height))
            }
            Transform::QwenSmart {
                factor,
                min_pixels,
                max_pixels,
            } => {
                let (oh, ow) = smart_resize(h, w, factor, min_pixels, max_pixels)?;
                Ok((ow, oh))
            }
        }
    }

    /// Pixels a sample's slot holds: the output size where it is fixed; qwenSmart sizes vary,
    /// so one megapixel per sample.
    pub fn slot_pixels(&self) -> u64 {
        match *self {
            Transform::Crop { width, height } | Transform::Fit { width, height, .. } => {
                u64::from(width) * u64::from(height)
            }
            Transform::QwenSmart { .. } => 1024 * 1024,
        }
    }

    /// The smallest decoded size that still feeds the output at full resolution: lets the JPEG
    /// decoder scale in the DCT domain down to it.
    pub fn min_source_size(&self, w: u32, h: u32) -> Result<(u32, u32), TransformError> {
        let (ow, oh) = self.output_size(w, h)?;
        let (sx, sy) = (f64::from(ow) / f64::from(w), f64::from(oh) / f64::from(h));
        let s = match self {
            Transform::Fit { .. } => sx.min(sy),
            _ => sx.max(sy),
        };
        // The epsilon keeps float noise (448.0000001) from asking for one more pixel.
        Ok((
            (f64::from(w) * s - 1e-6).ceil() as u32,
            (f64::from(h) * s - 1e-6).ceil() as u32,
        ))
    }

    /// The part of a `w` x `h` image (after orientation) that the output is made from, with a
    /// margin for the resampling filter's reach; `None` when that is the whole image. Only
    /// `crop` leaves anything out. Decoding just this part and handing it to
    /// [`Transform::apply_region`] gives the output of the whole image.
    pub fn source_window(&self, w: u32, h: u32) -> Option<Rect> {
        let Transform::Crop { width, height } = *self else {
            return None;
        };
        let (fw, fh) = (f64::from(w), f64::from(h));
        let (left, top, cw, ch) = crop_box(fw, fh, width, height);
        // The bilinear filter reaches one output pixel (1/s source pixels) past the box when
        // downscaling, one source pixel when upscaling; one more for rounding.
        let margin = (f64::from(w) / f64::from(width))
            .min(f64::from(h) / f64::from(height))
            .max(1.0)
            .ceil()
            + 1.0;
        let x0 = (left - margin).floor().max(0.0) as u32;
        let y0 = (top - margin).floor().max(0.0) as u32;
        let x1 = ((left + cw + margin).ceil() as u32).min(w);
        let y1 = ((top + ch + margin).ceil() as u32).min(h);
        Rect::part_of((x0, y0), (x1, y1), (w, h))
    }

    /// Resizes packed RGB8 `src` (`sw` x `sh`) into `dst`, which holds exactly the output size
    /// (`output_size` of the original image) as packed HWC.
    pub fn apply(
        &self,
        src: &[u8],
        sw: u32,
        sh: u32,
        out_size: (u32, u32),
        dst: &mut [u8],
        resampler: &mut Resampler,
    ) -> Result<(), TransformError> {
        let whole = Rect {
            x: 0,
            y: 0,
            width: sw,
            height: sh,
        };
        self.apply_region(src, whole, (sw, sh), out_size, dst, resampler)
    }

    /// [`Transform::apply`] for `src`, the pixels of `region` of a `full` (width, height)
    /// image: the output is that of the full image, as long as `region` covers the
    /// [`Transform::source_window`] (scaled to `full`).
    pub fn apply_region(
        &self,
        src: &[u8],
        region: Rect,
        full: (u32, u32),
        out_size: (u32, u32),
        dst: &mut [u8],
        resampler: &mut Resampler,
    ) -> Result<(), TransformError> {
        let (ow, oh) = out_size;
        let (sw, sh) = (region.width, region.height);
        let src_img = ImageRef::new(sw, sh, src, PixelType::U8x3).map_err(resize_error)?;
        let whole_source = (0.0, 0.0, f64::from(sw), f64::from(sh));
        let whole_output = Rect {
            x: 0,
            y: 0,
            width: ow,
            height: oh,
        };
        match *self {
            Transform::Crop { .. } => {
                let (left, top, cw, ch) = crop_box(f64::from(full.0), f64::from(full.1), ow, oh);
                let source_box = (
                    left - f64::from(region.x),
                    top - f64::from(region.y),
                    cw,
                    ch,
                );
                resampler.resize(&src_img, source_box, dst, ow, whole_output)
            }
            Transform::Fit { pad, .. } => {
                let (iw, ih) = fit_inner_size(sw, sh, ow, oh);
                dst.fill(pad);
                let inner = Rect {
                    x: (ow - iw) / 2,
                    y: (oh - ih) / 2,
                    width: iw,
                    height: ih,
                };
                resampler.resize(&src_img, whole_source, dst, ow, inner)
            }
            Transform::QwenSmart { .. } => {
                resampler.resize(&src_img, whole_source, dst, ow, whole_output)
            }
        }
    }
}

/// What a thread keeps from one resize to the next: the resizer (its coefficient and
/// intermediate buffers), the staged output and the rows of a horizontal-first pass.
#[derive(Default)]
pub struct Resampler {
    resizer: Resizer,
    staged: Vec<u8>,
    rows: Vec<u8>,
}

impl Resampler {
    /// Bilinear resize of `source_box` (left, top, width, height, in `src` pixels) onto the
    /// `inner` part of `dst`, an RGB8 image `dst_width` pixels wide.
    ///
    /// Two passes, in the cheaper order, and the last pass's writes kept cheap:
    /// - fast_image_resize runs the vertical pass first for u8 pixels, so its horizontal pass,
    ///   the costlier one, runs over every output row. When the box grows vertically (a
    ///   375-row crop to 448 rows), the horizontal pass runs first here, over the box's own
    ///   rows: ~15-20% cheaper. The intermediate rows are rounded to u8 either way, so the
    ///   outputs differ by at most one level.
    /// - The horizontal pass writes four rows at a time, which cold memory (a batch buffer)
    ///   takes badly: the same resize took ~1.5x as long. When it comes last, the output is
    ///   made in a buffer of this thread's, which stays in cache, and copied out. The vertical
    ///   pass writes whole rows in order, so it writes to `dst` directly.
    fn resize(
        &mut self,
        src: &ImageRef<'_>,
        source_box: (f64, f64, f64, f64),
        dst: &mut [u8],
        dst_width: u32,
        inner: Rect,
    ) -> Result<(), TransformError> {
        let alg = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        let (left, top, cw, ch) = source_box;
        let (iw, ih) = (inner.width, inner.height);
        let grows_vertically = ch < f64::from(ih);
        let narrows_or_shifts = f64::from(iw) != cw || left != left.round();
        if grows_vertically && narrows_or_shifts {
            // The box's rows and one more on each side: the filter reaches that far when
            // upscaling.
            let y0 = (top.floor() - 1.0).max(0.0) as u32;
            let y1 = ((top + ch).ceil() as u32 + 1).min(src.height());
            let th = y1 - y0;
            let len = iw as usize * th as usize * 3;
            if self.rows.len() < len {
                self.rows.resize(len, 0);
            }
            let mut mid = Image::from_slice_u8(iw, th, &mut self.rows[..len], PixelType::U8x3)
                .map_err(resize_error)?;
            let rows_box = alg.crop(left, f64::from(y0), cw, f64::from(th));
            self.resizer
                .resize(src, &mut mid, &rows_box)
                .map_err(resize_error)?;
            let mid =
                ImageRef::new(iw, th, &self.rows[..len], PixelType::U8x3).map_err(resize_error)?;
            let dst_height = (dst.len() / (dst_width as usize * 3)) as u32;
            let mut out = Image::from_slice_u8(dst_width, dst_height, dst, PixelType::U8x3)
                .map_err(resize_error)?;
            let mut out =
                CroppedImageMut::new(&mut out, inner.x, inner.y, iw, ih).map_err(resize_error)?;
            let column_box = alg.crop(0.0, top - f64::from(y0), f64::from(iw), ch);
            return self
                .resizer
                .resize(&mid, &mut out, &column_box)
                .map_err(resize_error);
        }
        let len = iw as usize * ih as usize * 3;
        if self.staged.len() < len {
            self.staged.resize(len, 0);
        }
        let staged = &mut self.staged[..len];
        let mut out =
            Image::from_slice_u8(iw, ih, staged, PixelType::U8x3).map_err(resize_error)?;
        self.resizer
            .resize(src, &mut out, &alg.crop(left, top, cw, ch))
            .map_err(resize_error)?;
        let row = iw as usize * 3;
        let stride = dst_width as usize * 3;
        let at = (inner.y as usize * dst_width as usize + inner.x as usize) * 3;
        if row == stride {
            dst[at..at + len].copy_from_slice(&self.staged[..len]);
        } else {
            for (i, r) in self.staged[..len].chunks_exact(row).enumerate() {
                dst[at + i * stride..][..row].copy_from_slice(r);
            }
        }
        Ok(())
    }
}

fn resize_error(e: impl std::fmt::Display) -> TransformError {
    TransformError::Resize {
        detail: e.to_string(),
    }
}

/// `crop`'s box in a `fw` x `fh` image for a `ow` x `oh` output: (left, top, width, height),
/// the largest centered box of the output's aspect.
fn crop_box(fw: f64, fh: f64, ow: u32, oh: u32) -> (f64, f64, f64, f64) {
    let s = (f64::from(ow) / fw).max(f64::from(oh) / fh);
    let (cw, ch) = ((f64::from(ow) / s).min(fw), (f64::from(oh) / s).min(fh));
    ((fw - cw) / 2.0, (fh - ch) / 2.0, cw, ch)
}

/// Largest output of any mode: bounds memory per sample whatever a request asks for. The
/// CRD's rules refuse larger outputs with the same number.
pub use stoker_contract::MAX_OUTPUT_PIXELS;

/// Size of the scaled image inside a `fit` letterbox.
pub fn fit_inner_size(sw: u32, sh: u32, ow: u32, oh: u32) -> (u32, u32) {
    let s = (f64::from(ow) / f64::from(sw)).min(f64::from(oh) / f64::from(sh));
    let iw = ((f64::from(sw) * s).round() as u32).clamp(1, ow);
    let ih = ((f64::from(sh) * s).round() as u32).clamp(1, oh);
    (iw, ih)
}

/// Qwen-VL's `smart_resize(height, width, factor, min_pixels, max_pixels)` -> (height, width),
/// with Python's round-half-to-even so sizes match the reference processor exactly.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), TransformError> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if height == 0 || width == 0 || factor == 0 {
        return Err(TransformError::BadGeometry {
            detail: format!("{width}x{height} with factor {factor}"),
        });
    }
    if h.max(w) / h.min(w) > 200.0 {
        return Err(TransformError::BadGeometry {
            detail: format!("aspect ratio of {width}x{height} is above 200"),
        });
    }
    let mut h_bar = f.max((h / f).round_ties_even() * f);
    let mut w_bar = f.max((w / f).round_ties_even() * f);
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

#[derive(Debug, thiserror::Error)]
pub enum TransformError {
    #[error("invalid transform: {detail}")]
    InvalidSettings { detail: String },
    #[error("no output size for this image: {detail}")]
    BadGeometry { detail: String },
    #[error("resize failed: {detail}")]
    Resize { detail: String },
}

impl TransformError {
    pub fn category(&self) -> &'static str {
        match self {
            TransformError::InvalidSettings { .. } => "invalid_settings",
            TransformError::BadGeometry { .. } => "bad_geometry",
            TransformError::Resize { .. } => "resize",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_the_reference_processor() {
        // Values from Qwen2-VL's smart_resize in Python (factor 28, 56*56..28*28*1280).
        let (min, max) = (56 * 56, 28 * 28 * 1280);
        assert_eq!(smart_resize(375, 500, 28, min, max).unwrap(), (364, 504));
        assert_eq!(smart_resize(1200, 1600, 28, min, max).unwrap(), (840, 1148));
        assert_eq!(smart_resize(20, 30, 28, min, max).unwrap(), (56, 84));
        assert!(smart_resize(10, 3000, 28, min, max).is_err());
    }

    #[test]
    fn qwen_sizes_are_multiples_within_bounds() {
        let t = Transform::QwenSmart {
            factor: 32,
            min_pixels: 64 * 32 * 32,
            max_pixels: 1024 * 32 * 32,
        };
        for (w, h) in [(500, 375), (1600, 1200), (333, 1000), (4000, 100), (64, 64)] {
            let (ow, oh) = t.output_size(w, h).unwrap();
            assert_eq!(ow % 32, 0);
            assert_eq!(oh % 32, 0);
            let px = u64::from(ow) * u64::from(oh);
            assert!(
                (64 * 32 * 32..=1024 * 32 * 32).contains(&px),
                "{w}x{h} -> {ow}x{oh}"
            );
            let (ar_in, ar_out) = (f64::from(w) / f64::from(h), f64::from(ow) / f64::from(oh));
            assert!((ar_in / ar_out - 1.0).abs() < 0.35, "{w}x{h} -> {ow}x{oh}");
        }
    }

    #[test]
    fn min_source_size_follows_the_mode() {
        let crop = Transform::Crop {
            width: 448,
            height: 448,
        };
        assert_eq!(crop.min_source_size(1600, 1200).unwrap(), (598, 448));
        let fit = Transform::Fit {
            width: 448,
            height: 448,
            pad: 0,
        };
        assert_eq!(fit.min_source_size(1600, 1200).unwrap(), (448, 336));
    }

    #[test]
    fn crop_window_is_the_centered_box_with_a_margin() {
        let crop = Transform::Crop {
            width: 448,
            height: 448,
        };
        // 1600x1200: box 1200x1200 at x 200; 2.68 source pixels per output pixel -> margin 4.
        assert_eq!(
            crop.source_window(1600, 1200),
            Some(Rect {
                x: 196,
                y: 0,
                width: 1208,
                height: 1200
            })
        );
        assert_eq!(crop.source_window(448, 448), None);
        let fit = Transform::Fit {
            width: 448,
            height: 448,
            pad: 0,
        };
        assert_eq!(fit.source_window(1600, 1200), None);
    }

    /// The horizontal-first order (taken when the box grows vertically) gives the library's
    /// one-call output within one level, edges included: portrait crops start at a fractional
    /// row, and the noise makes every neighbouring row differ.
    #[test]
    fn horizontal_first_matches_one_call() {
        let alg = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        let mut rng = fastrand::Rng::with_seed(7);
        for (w, h) in [(500, 375), (375, 500), (333, 500), (400, 300), (101, 67)] {
            let src: Vec<u8> = (0..w * h * 3).map(|_| rng.u8(..)).collect();
            let src_img = ImageRef::new(w, h, &src, PixelType::U8x3).unwrap();
            let (left, top, cw, ch) = crop_box(f64::from(w), f64::from(h), 448, 448);
            assert!(ch < 448.0, "{w}x{h} must take the horizontal-first path");
            let mut one_call = vec![0u8; 448 * 448 * 3];
            let mut img = Image::from_slice_u8(448, 448, &mut one_call, PixelType::U8x3).unwrap();
            Resizer::new()
                .resize(&src_img, &mut img, &alg.crop(left, top, cw, ch))
                .unwrap();
            let mut ours = vec![0u8; 448 * 448 * 3];
            let whole = Rect {
                x: 0,
                y: 0,
                width: 448,
                height: 448,
            };
            Resampler::default()
                .resize(&src_img, (left, top, cw, ch), &mut ours, 448, whole)
                .unwrap();
            let worst = one_call
                .iter()
                .zip(&ours)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap();
            assert!(worst <= 1, "{w}x{h}: a pixel differs by {worst} levels");
        }
    }

    #[test]
    fn fit_pads_and_centers() {
        let fit = Transform::Fit {
            width: 8,
            height: 8,
            pad: 7,
        };
        let mut dst = vec![0u8; 8 * 8 * 3];
        // A wide 8x4 image, then a 4x2 one, which grows vertically: its horizontal pass runs
        // first and its vertical pass writes into the letterbox directly. Both give rows 0-1
        // and 6-7 of padding and rows 2-5 of image.
        for (w, h) in [(8u32, 4u32), (4, 2)] {
            let src = vec![200u8; (w * h * 3) as usize];
            dst.fill(0);
            fit.apply(&src, w, h, (8, 8), &mut dst, &mut Resampler::default())
                .unwrap();
            assert!(dst[..2 * 8 * 3].iter().all(|&v| v == 7), "{w}x{h}");
            assert!(
                dst[2 * 8 * 3..6 * 8 * 3].iter().all(|&v| v == 200),
                "{w}x{h}"
            );
            assert!(dst[6 * 8 * 3..].iter().all(|&v| v == 7), "{w}x{h}");
        }
        // A tall image: columns 0-1 and 6-7 are padding, on every row.
        let src = vec![200u8; 4 * 8 * 3];
        fit.apply(&src, 4, 8, (8, 8), &mut dst, &mut Resampler::default())
            .unwrap();
        for row in dst.chunks_exact(8 * 3) {
            assert!(row[..2 * 3].iter().all(|&v| v == 7));
            assert!(row[2 * 3..6 * 3].iter().all(|&v| v == 200));
            assert!(row[6 * 3..].iter().all(|&v| v == 7));
        }
    }
}
