//! Resize modes end to end through the engine: shapes (ragged qwenSmart batches included) and
//! pixels close to a reference resize done by the `image` crate on the same decoded image.

mod common;

use bytes::Bytes;
use common::*;
use image::imageops::{self, FilterType};
use stoker_loader::decode::{DecodeLimits, SkipReason};
use stoker_loader::{EncodedSample, Transform, decode_batch, decode_batch_into};

fn sample(key: &str, data: Vec<u8>) -> EncodedSample {
    EncodedSample {
        key: key.into(),
        metadata: String::new(),
        data: Ok(Bytes::from(data)),
    }
}

fn reference_crop(rgb: &[u8], w: u32, h: u32, tw: u32, th: u32) -> Vec<u8> {
    let img = image::RgbImage::from_raw(w, h, rgb.to_vec()).unwrap();
    let s = (f64::from(tw) / f64::from(w)).max(f64::from(th) / f64::from(h));
    let (rw, rh) = (
        (f64::from(w) * s).round() as u32,
        (f64::from(h) * s).round() as u32,
    );
    let resized = imageops::resize(&img, rw.max(tw), rh.max(th), FilterType::Triangle);
    let (l, t) = ((resized.width() - tw) / 2, (resized.height() - th) / 2);
    imageops::crop_imm(&resized, l, t, tw, th)
        .to_image()
        .into_raw()
}

#[test]
fn crop_matches_a_reference_resize_with_and_without_dct_scaling() {
    // 1600x1200 needs a 598x448 source, less than half its size: decoded at 1/2 in the DCT
    // domain. 600x450 and 450x600 are decoded at full size.
    for (w, h) in [(1600u32, 1200u32), (600, 450), (450, 600)] {
        let rgb = pattern(w, h);
        let data = jpeg_of(&rgb, w, h);
        let t = Transform::Crop {
            width: 448,
            height: 448,
        };
        let batch = decode_batch(&[sample("a", data)], &t, &DecodeLimits::default());
        assert_eq!(batch.samples[0].skip, None);
        assert_eq!(
            (batch.samples[0].width, batch.samples[0].height),
            (448, 448)
        );
        assert_eq!(batch.pixels.len(), 448 * 448 * 3);
        let want = reference_crop(&rgb, w, h, 448, 448);
        let diff = mean_abs_diff(&batch.pixels, &want);
        assert!(diff < 4.0, "{w}x{h}: mean abs diff {diff}");
    }
}

#[test]
fn a_batch_decodes_into_a_callers_buffer_and_skips_what_does_not_fit() {
    let t = Transform::Crop {
        width: 64,
        height: 64,
    };
    let limits = DecodeLimits::default();
    let samples = [
        sample("a", jpeg(200, 100)),
        sample("b", png(120, 90)),
        sample("c", jpeg(90, 120)),
    ];
    let whole = decode_batch(&samples, &t, &limits);
    let mut slot = vec![0u8; whole.pixels.len()];
    let into = decode_batch_into(&samples, &t, &limits, &mut slot);
    assert_eq!(into.samples, whole.samples);
    assert_eq!(into.bytes, whole.pixels.len());
    assert_eq!(
        slot, whole.pixels,
        "the same pixels, in the caller's buffer"
    );

    // Room for two samples and a bit: the third is skipped before anything is decoded.
    let one = 64 * 64 * 3;
    let mut small = vec![0u8; 2 * one + 100];
    let into = decode_batch_into(&samples, &t, &limits, &mut small);
    assert_eq!(into.samples[2].skip, Some(SkipReason::TooLarge));
    assert_eq!(into.samples[2].byte_len(), 0);
    assert_eq!(into.bytes, 2 * one);
    assert_eq!(small[..2 * one], whole.pixels[..2 * one]);
}

#[test]
fn fit_letterboxes_inside_the_target() {
    let (w, h) = (800u32, 400u32);
    let rgb = pattern(w, h);
    let t = Transform::Fit {
        width: 256,
        height: 256,
        pad: 0,
    };
    let batch = decode_batch(&[sample("p", png(w, h))], &t, &DecodeLimits::default());
    assert_eq!(
        (batch.samples[0].width, batch.samples[0].height),
        (256, 256)
    );
    let px = &batch.pixels;
    // 800x400 scaled into 256x256 is 256x128, centered: rows 0..64 and 192..256 are padding.
    let row = |y: usize| &px[y * 256 * 3..(y + 1) * 256 * 3];
    assert!(row(0).iter().all(|&v| v == 0));
    assert!(row(63).iter().all(|&v| v == 0));
    assert!(row(255).iter().all(|&v| v == 0));
    let inner: Vec<u8> = (64..192).flat_map(|y| row(y).to_vec()).collect();
    let img = image::RgbImage::from_raw(w, h, rgb).unwrap();
    let want = imageops::resize(&img, 256, 128, FilterType::Triangle).into_raw();
    let diff = mean_abs_diff(&inner, &want);
    assert!(diff < 3.0, "mean abs diff {diff}");
}

#[test]
fn qwen_smart_batches_are_ragged_with_consistent_offsets() {
    let t = Transform::QwenSmart {
        factor: 28,
        min_pixels: 56 * 56,
        max_pixels: 28 * 28 * 256,
    };
    let inputs = [
        ("wide.jpg", jpeg(900, 300)),
        ("tall.png", png(240, 640)),
        ("square.webp", webp(333, 333)),
        ("bad.txt", b"not an image".to_vec()),
        ("small.jpg", jpeg(40, 30)),
    ];
    let samples: Vec<EncodedSample> = inputs.iter().map(|(k, d)| sample(k, d.clone())).collect();
    let batch = decode_batch(&samples, &t, &DecodeLimits::default());
    let mut expected_offset = 0u64;
    for (m, (key, _)) in batch.samples.iter().zip(&inputs) {
        assert_eq!(&m.key, key);
        assert_eq!(m.offset, expected_offset, "{key}");
        if *key == "bad.txt" {
            assert_eq!(m.skip.map(|r| r.as_str()), Some("unsupported"));
            assert_eq!(m.byte_len(), 0);
            continue;
        }
        assert_eq!(m.skip, None, "{key}");
        assert_eq!(m.width % 28, 0, "{key}");
        assert_eq!(m.height % 28, 0, "{key}");
        let px = u64::from(m.width) * u64::from(m.height);
        assert!(
            (56 * 56..=28 * 28 * 256).contains(&px),
            "{key}: {}x{}",
            m.width,
            m.height
        );
        let (ow, oh) = stoker_loader::transform::smart_resize(
            m.orig_height,
            m.orig_width,
            28,
            56 * 56,
            28 * 28 * 256,
        )
        .map(|(h, w)| (w, h))
        .unwrap();
        assert_eq!((m.width, m.height), (ow, oh), "{key}");
        expected_offset += m.byte_len() as u64;
    }
    assert_eq!(batch.pixels.len() as u64, expected_offset);
    let shapes: std::collections::HashSet<(u32, u32)> = batch
        .samples
        .iter()
        .filter(|m| m.skip.is_none())
        .map(|m| (m.width, m.height))
        .collect();
    assert!(shapes.len() >= 3, "ragged batch: {shapes:?}");
    // The wide image's pixels look like the reference resize of its source.
    let wide = &batch.samples[0];
    let img = image::RgbImage::from_raw(900, 300, pattern(900, 300)).unwrap();
    let want = imageops::resize(&img, wide.width, wide.height, FilterType::Triangle).into_raw();
    let diff = mean_abs_diff(batch.sample_pixels(0), &want);
    assert!(diff < 4.0, "mean abs diff {diff}");
}

#[test]
fn grayscale_alpha_and_exif_orientation_become_upright_rgb() {
    let t = Transform::Crop {
        width: 64,
        height: 64,
    };
    // Grayscale JPEG.
    let gray: Vec<u8> = (0..128 * 128).map(|i| (i % 256) as u8).collect();
    let gray_jpeg = turbojpeg::compress(
        turbojpeg::Image {
            pixels: gray.as_slice(),
            width: 128,
            pitch: 128,
            height: 128,
            format: turbojpeg::PixelFormat::GRAY,
        },
        90,
        turbojpeg::Subsamp::Gray,
    )
    .unwrap()
    .to_vec();
    // Fully transparent PNG: composited over white.
    let clear = png_rgba(64, 64, 0);
    // A JPEG of a 200x100 pattern tagged "rotate 90° clockwise" (EXIF orientation 6).
    let rotated = with_exif_orientation(&jpeg(200, 100), 6);
    let batch = decode_batch(
        &[sample("g", gray_jpeg), sample("a", clear)],
        &t,
        &DecodeLimits::default(),
    );
    assert!(
        batch.samples.iter().all(|m| m.skip.is_none()),
        "{:?}",
        batch.samples
    );
    let g = batch.sample_pixels(0);
    assert!(
        g.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]),
        "gray stays gray in RGB"
    );
    assert!(
        batch.sample_pixels(1).iter().all(|&v| v == 255),
        "transparent over white"
    );

    assert_upright_after_clockwise_rotation(rotated);
}

#[test]
fn png_exif_orientation_is_applied() {
    // The same 200x100 pattern as a PNG whose eXIf chunk says "rotate 90° clockwise".
    assert_upright_after_clockwise_rotation(png_with_exif_orientation(&png(200, 100), 6));
}

/// `data` holds the 200x100 pattern tagged "rotate 90° clockwise": it must come out 100x200.
fn assert_upright_after_clockwise_rotation(data: Vec<u8>) {
    // Fit keeps the whole image: 100x200 upright becomes 32x64 at x = 16..48.
    let fit = Transform::Fit {
        width: 64,
        height: 64,
        pad: 0,
    };
    let batch = decode_batch(&[sample("r", data)], &fit, &DecodeLimits::default());
    let r = &batch.samples[0];
    assert_eq!(r.skip, None);
    assert_eq!(
        (r.orig_width, r.orig_height),
        (100, 200),
        "size after orientation"
    );
    // The bright block (top-left of the stored image) ends top-right once rotated clockwise.
    let px = batch.sample_pixels(0);
    let at = |x: usize, y: usize| px[(y * 64 + x) * 3];
    assert!(at(45, 4) > 200, "top-right is the red block: {}", at(45, 4));
    assert!(at(18, 4) < 150, "top-left is not: {}", at(18, 4));
    assert_eq!(at(5, 30), 0, "padding");
}

/// A little-endian TIFF block whose IFD0 holds only the orientation tag.
fn exif_tiff(orientation: u16) -> Vec<u8> {
    let mut tiff = b"II\x2a\0\x08\0\0\0\x01\0".to_vec();
    tiff.extend_from_slice(&[0x12, 0x01, 3, 0, 1, 0, 0, 0]);
    tiff.extend_from_slice(&orientation.to_le_bytes());
    tiff.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    tiff
}

/// Inserts an eXIf chunk with the orientation tag right after IHDR (it must precede IDAT).
fn png_with_exif_orientation(png: &[u8], orientation: u16) -> Vec<u8> {
    let tiff = exif_tiff(orientation);
    // Signature (8) + IHDR: length (4), type (4), 13 bytes of data, CRC (4).
    let after_ihdr = 8 + 4 + 4 + 13 + 4;
    let mut chunk = (tiff.len() as u32).to_be_bytes().to_vec();
    chunk.extend_from_slice(b"eXIf");
    chunk.extend_from_slice(&tiff);
    chunk.extend_from_slice(&crc32(&chunk[4..]).to_be_bytes());
    let mut out = png[..after_ihdr].to_vec();
    out.extend_from_slice(&chunk);
    out.extend_from_slice(&png[after_ihdr..]);
    out
}

/// PNG's CRC-32 (ISO 3309), bit by bit: the decoder checks every chunk's.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Inserts an APP1 EXIF segment with the orientation tag right after SOI.
fn with_exif_orientation(jpeg: &[u8], orientation: u16) -> Vec<u8> {
    let tiff = exif_tiff(orientation);
    let mut out = jpeg[..2].to_vec();
    out.extend_from_slice(&[0xFF, 0xE1]);
    out.extend_from_slice(&((2 + 6 + tiff.len()) as u16).to_be_bytes());
    out.extend_from_slice(b"Exif\0\0");
    out.extend_from_slice(&tiff);
    out.extend_from_slice(&jpeg[2..]);
    out
}

#[test]
fn cmyk_jpeg_becomes_rgb() {
    // Adobe CMYK JPEGs store inverted ink: 255 means no ink. Cyan ink only: (0, 255, 255, 255).
    let (w, h) = (64usize, 48usize);
    let cmyk: Vec<u8> = (0..w * h).flat_map(|_| [0u8, 255, 255, 255]).collect();
    let data = turbojpeg::compress(
        turbojpeg::Image {
            pixels: cmyk.as_slice(),
            width: w,
            pitch: w * 4,
            height: h,
            format: turbojpeg::PixelFormat::CMYK,
        },
        95,
        turbojpeg::Subsamp::None,
    )
    .unwrap()
    .to_vec();
    let t = Transform::Crop {
        width: 32,
        height: 32,
    };
    let batch = decode_batch(&[sample("cmyk", data)], &t, &DecodeLimits::default());
    assert_eq!(batch.samples[0].skip, None);
    let px = batch.sample_pixels(0);
    assert_eq!(px.len(), 32 * 32 * 3);
    // Cyan: no red, full green and blue.
    let mean = |c: usize| {
        px.iter()
            .skip(c)
            .step_by(3)
            .map(|&v| f64::from(v))
            .sum::<f64>()
            / 1024.0
    };
    assert!(
        mean(0) < 20.0 && mean(1) > 235.0 && mean(2) > 235.0,
        "{} {} {}",
        mean(0),
        mean(1),
        mean(2)
    );
}
