//! The decode path's shortcuts (DCT-domain scaling picked from the target in every mode, the
//! crop window, the pooled reply buffers, the PNG and WebP decoders) against the plain path:
//! every image decoded at full resolution by a reference decoder (libjpeg-turbo unscaled for
//! JPEG, the `image` crate for PNG and WebP), then the same resize. 100 photo-like images of
//! 320x240 to 3000x2000, JPEG (4:2:0, 4:2:2, 4:4:4, gray), PNG (RGB, gray, 16-bit) and WebP,
//! through `crop`, `fit` and `qwenSmart`: each output within 38 dB PSNR of the plain path's.

mod common;

use bytes::Bytes;
use image::ImageEncoder;
use stoker_loader::batch::{PixelPool, decode_batch_pooled};
use stoker_loader::decode::DecodeLimits;
use stoker_loader::transform::Resampler;
use stoker_loader::{EncodedSample, Transform, decode_batch};

/// The tolerance: 38 dB is a mean error of about 2.5 levels out of 255.
const MIN_PSNR_DB: f64 = 38.0;

/// A photo-like image: smooth shading from a few low-frequency waves, objects with hard edges,
/// fine texture and sensor noise.
fn photo(w: u32, h: u32, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let waves: Vec<(f64, f64, f64, usize)> = (0..6)
        .map(|i| {
            (
                rng.f64() * 6.0 + 0.5,
                rng.f64() * 6.0 + 0.5,
                rng.f64() * 6.3,
                i % 3,
            )
        })
        .collect();
    let boxes: Vec<(u32, u32, u32, u32, [u8; 3])> = (0..5)
        .map(|_| {
            let (bw, bh) = (rng.u32(w / 10..w / 3), rng.u32(h / 10..h / 3));
            (
                rng.u32(0..w - bw),
                rng.u32(0..h - bh),
                bw,
                bh,
                [rng.u8(..), rng.u8(..), rng.u8(..)],
            )
        })
        .collect();
    let mut out = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let (u, v) = (f64::from(x) / f64::from(w), f64::from(y) / f64::from(h));
            let mut px = [110.0f64, 120.0, 100.0];
            for &(fu, fv, phase, c) in &waves {
                px[c] += 45.0 * (std::f64::consts::TAU * (fu * u + fv * v) + phase).sin();
            }
            if let Some(&(.., color)) = boxes
                .iter()
                .find(|&&(bx, by, bw, bh, _)| x >= bx && x < bx + bw && y >= by && y < by + bh)
            {
                for c in 0..3 {
                    px[c] = px[c] * 0.3 + f64::from(color[c]) * 0.7;
                }
            }
            let texture = if (x / 3 + y / 3) % 2 == 0 { 6.0 } else { -6.0 };
            for p in px {
                let noise = f64::from(rng.i32(-4..=4));
                out.push((p + texture + noise).clamp(0.0, 255.0) as u8);
            }
        }
    }
    out
}

fn jpeg(rgb: &[u8], w: u32, h: u32, subsamp: turbojpeg::Subsamp, quality: i32) -> Vec<u8> {
    let img = turbojpeg::Image {
        pixels: rgb,
        width: w as usize,
        pitch: w as usize * 3,
        height: h as usize,
        format: turbojpeg::PixelFormat::RGB,
    };
    turbojpeg::compress(img, quality, subsamp).unwrap().to_vec()
}

fn png(rgb: &[u8], w: u32, h: u32, kind: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let enc = image::codecs::png::PngEncoder::new(&mut out);
    match kind {
        0 => enc.write_image(rgb, w, h, image::ExtendedColorType::Rgb8),
        1 => {
            let gray: Vec<u8> = rgb.chunks(3).map(|p| p[1]).collect();
            enc.write_image(&gray, w, h, image::ExtendedColorType::L8)
        }
        _ => {
            // 16-bit big-endian samples, as PNG stores them.
            let wide: Vec<u8> = rgb.iter().flat_map(|&v| [v, v]).collect();
            enc.write_image(&wide, w, h, image::ExtendedColorType::Rgb16)
        }
    }
    .unwrap();
    out
}

fn webp(rgb: &[u8], w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::webp::WebPEncoder::new_lossless(&mut out)
        .encode(rgb, w, h, image::ExtendedColorType::Rgb8)
        .unwrap();
    out
}

/// The hundred images: (name, encoded bytes).
fn corpus() -> Vec<(String, Vec<u8>)> {
    use turbojpeg::Subsamp;
    const SIZES: [(u32, u32); 10] = [
        (500, 375),
        (375, 500),
        (500, 333),
        (640, 480),
        (1024, 768),
        (1600, 1200),
        (1200, 1600),
        (2001, 1333),
        (3000, 2000),
        (899, 601),
    ];
    const SUBSAMPS: [Subsamp; 4] = [
        Subsamp::Sub2x2,
        Subsamp::Sub2x1,
        Subsamp::None,
        Subsamp::Gray,
    ];
    let mut out = Vec::new();
    for i in 0..100u32 {
        let (w, h) = SIZES[i as usize % SIZES.len()];
        // PNG and WebP are smaller, as in real sets (and slower to make in a test).
        let (w, h) = if i % 10 >= 7 { (w / 2, h / 2) } else { (w, h) };
        let rgb = photo(w, h, u64::from(i));
        let (name, data) = match i % 10 {
            0..=6 => {
                let s = SUBSAMPS[(i / 10) as usize % 4];
                let q = 80 + (i as i32 % 4) * 5;
                (
                    format!("{i:03}-{w}x{h}-{s:?}-q{q}.jpg"),
                    jpeg(&rgb, w, h, s, q),
                )
            }
            7 | 8 => {
                let kind = i / 10 % 3;
                (
                    format!("{i:03}-{w}x{h}-kind{kind}.png"),
                    png(&rgb, w, h, kind),
                )
            }
            _ => (format!("{i:03}-{w}x{h}.webp"), webp(&rgb, w, h)),
        };
        out.push((name, data));
    }
    out
}

/// The plain path: a full-resolution decode, then the same resize.
fn plain(data: &[u8], t: &Transform) -> (Vec<u8>, (u32, u32)) {
    let (rgb, w, h) = if data.starts_with(&[0xFF, 0xD8]) {
        let img = turbojpeg::decompress(data, turbojpeg::PixelFormat::RGB).unwrap();
        (img.pixels, img.width as u32, img.height as u32)
    } else {
        let img = image::load_from_memory(data).unwrap().to_rgb8();
        let (w, h) = img.dimensions();
        (img.into_raw(), w, h)
    };
    let out = t.output_size(w, h).unwrap();
    let mut dst = vec![0u8; (out.0 * out.1 * 3) as usize];
    t.apply(&rgb, w, h, out, &mut dst, &mut Resampler::default())
        .unwrap();
    (dst, out)
}

fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (255.0f64 * 255.0 / mse).log10()
    }
}

fn sample(key: &str, data: &[u8]) -> EncodedSample {
    EncodedSample {
        key: key.into(),
        metadata: format!("{{\"caption\": \"{key}\"}}"),
        data: Ok(Bytes::copy_from_slice(data)),
    }
}

#[test]
fn a_hundred_images_match_the_full_resolution_path_in_every_mode() {
    let corpus = corpus();
    let transforms = [
        Transform::Crop {
            width: 448,
            height: 448,
        },
        Transform::Fit {
            width: 448,
            height: 448,
            pad: 0,
        },
        Transform::QWEN25_VL,
        Transform::Crop {
            width: 224,
            height: 224,
        },
    ];
    let limits = DecodeLimits::default();
    let pool = PixelPool::new(2);
    let mut report = Vec::new();
    for t in &transforms {
        let mut worst: Vec<(f64, String)> = Vec::new();
        // Batches of 20, as a worker decodes them; the pooled path (the worker's) and the
        // plain one (the sidecar's local decode) must agree byte for byte.
        for chunk in corpus.chunks(20) {
            let samples: Vec<EncodedSample> = chunk
                .iter()
                .map(|(name, data)| sample(name, data))
                .collect();
            let pooled = decode_batch_pooled(samples.clone(), t, &limits, &pool);
            let batch = decode_batch(&samples, t, &limits);
            assert_eq!(pooled.samples, batch.samples);
            assert_eq!(&pooled.pixels[..], &batch.pixels[..]);
            for (i, (name, data)) in chunk.iter().enumerate() {
                let m = &batch.samples[i];
                assert_eq!(m.skip, None, "{name}");
                assert_eq!(m.key, *name);
                assert_eq!(m.metadata, samples[i].metadata);
                let (want, shape) = plain(data, t);
                assert_eq!((m.width, m.height), shape, "{name} {t:?}");
                let p = psnr(batch.sample_pixels(i), &want);
                assert!(p >= MIN_PSNR_DB, "{name} {t:?}: PSNR {p:.1} dB");
                // PNG and WebP (lossless) decode to the same pixels whatever the decoder.
                if !name.ends_with(".jpg") {
                    assert!(
                        p.is_infinite(),
                        "{name} {t:?}: PSNR {p:.1} dB, not identical"
                    );
                }
                worst.push((p, name.clone()));
            }
        }
        worst.sort_by(|a, b| a.0.total_cmp(&b.0));
        report.push(format!(
            "{t:?}: worst PSNR {:.1} dB ({}), median {:.1} dB",
            worst[0].0,
            worst[0].1,
            worst[worst.len() / 2].0
        ));
    }
    eprintln!("{}", report.join("\n"));
    // Five batches of one shape per transform: the pool allocated once per size it saw.
    assert!(
        pool.allocations() <= 8,
        "{} allocations",
        pool.allocations()
    );
}

#[test]
fn pooled_buffers_come_back_when_the_reply_is_dropped() {
    let pool = PixelPool::new(1);
    let t = Transform::Crop {
        width: 64,
        height: 64,
    };
    let rgb = photo(320, 240, 7);
    let data = jpeg(&rgb, 320, 240, turbojpeg::Subsamp::Sub2x2, 90);
    let limits = DecodeLimits::default();
    for round in 0..5 {
        let b = decode_batch_pooled(vec![sample("a", &data); 4], &t, &limits, &pool);
        assert_eq!(b.pixels.len(), 4 * 64 * 64 * 3);
        // A clone of the reply's bytes (tonic holds one while encoding) keeps the buffer out.
        let held = b.pixels.clone();
        drop(b);
        assert_eq!(held.len(), 4 * 64 * 64 * 3);
        drop(held);
        assert_eq!(pool.allocations(), 1, "round {round}");
    }
    // Two replies alive at once need two buffers.
    let a = decode_batch_pooled(vec![sample("a", &data); 4], &t, &limits, &pool);
    let b = decode_batch_pooled(vec![sample("b", &data); 4], &t, &limits, &pool);
    assert_eq!(pool.allocations(), 2);
    assert_eq!(a.pixels, b.pixels);
}
