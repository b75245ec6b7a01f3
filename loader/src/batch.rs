//! The decode engine's entry point: [`decode_batch`] turns the encoded bytes of one batch into
//! packed uint8 HWC pixels plus per-sample metadata.
//!
//! Three passes: probe every header (cheap) to learn each output's shape and skip bad files
//! before allocating; allocate the batch buffer once at its exact size (or take the caller's,
//! [`decode_batch_into`]); decode and resize every sample in parallel straight into its own
//! slice of that buffer. Samples that fail in the last
//! pass leave a hole that is closed by moving the later samples down.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rayon::prelude::*;

use crate::decode::{self, DecodeLimits, Probe, SkipReason};
use crate::transform::{Resampler, Transform};

/// One sample's encoded bytes, or the reason it could not be fetched.
#[derive(Debug, Clone)]
pub struct EncodedSample {
    pub key: String,
    /// Manifest metadata (caption, label, ...), carried through unchanged.
    pub metadata: String,
    pub data: Result<Bytes, SkipReason>,
}

/// Per-sample result in a [`Batch`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SampleMeta {
    pub key: String,
    pub metadata: String,
    /// Size after EXIF orientation; (0, 0) when the header was unreadable.
    pub orig_width: u32,
    pub orig_height: u32,
    /// Output shape (HWC with C = 3) and start in [`Batch::pixels`]; zero when skipped.
    pub width: u32,
    pub height: u32,
    pub offset: u64,
    pub encoded_bytes: u64,
    pub skip: Option<SkipReason>,
}

impl SampleMeta {
    pub fn byte_len(&self) -> usize {
        self.width as usize * self.height as usize * 3
    }
}

/// CPU time spent per stage, summed over samples (thread CPU time, so other processes on the
/// machine do not inflate it), plus the wall time of each pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchTimings {
    pub decode_cpu: Duration,
    pub resize_cpu: Duration,
    pub probe_wall: Duration,
    pub decode_wall: Duration,
    pub pack_wall: Duration,
}

/// A decoded batch: pixels of decoded samples back to back in sample order.
#[derive(Debug, Default)]
pub struct Batch {
    pub pixels: Vec<u8>,
    pub samples: Vec<SampleMeta>,
    pub timings: BatchTimings,
}

impl Batch {
    /// The pixels of sample `i`, empty when it was skipped.
    pub fn sample_pixels(&self, i: usize) -> &[u8] {
        let m = &self.samples[i];
        let start = m.offset as usize;
        &self.pixels[start..start + m.byte_len()]
    }

    pub fn decoded_count(&self) -> usize {
        self.samples.iter().filter(|s| s.skip.is_none()).count()
    }
}

/// Scratch buffers of one pool thread, reused across samples: decoded and oriented images and
/// the resampler's.
#[derive(Default)]
struct Scratch {
    decoded: Vec<u8>,
    oriented: Vec<u8>,
    resampler: Resampler,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

struct Plan {
    probe: Probe,
    out: (u32, u32),
}

/// Decodes and transforms one batch on the current rayon pool (call it inside
/// `ThreadPool::install` to choose the pool). Never panics on bad input: every failure becomes
/// a skip with its reason, logged with the key.
pub fn decode_batch(
    samples: &[EncodedSample],
    transform: &Transform,
    limits: &DecodeLimits,
) -> Batch {
    let planned = PlannedBatch::new(samples, cloned_names(samples), transform, limits);
    // One allocation for the batch, at its exact size.
    let mut pixels = vec![0u8; planned.bytes()];
    let into = planned.decode_into(samples, transform, &mut pixels);
    pixels.truncate(into.bytes);
    Batch {
        pixels,
        samples: into.samples,
        timings: into.timings,
    }
}

/// A batch decoded into a buffer the caller owns (a shared-memory slot): its samples, with
/// offsets into that buffer, and how many of its bytes hold pixels.
#[derive(Debug, Default)]
pub struct DecodedInto {
    pub samples: Vec<SampleMeta>,
    pub timings: BatchTimings,
    pub bytes: usize,
}

/// [`decode_batch`] straight into `out`, with no intermediate buffer. Samples that would end
/// past `out` (variable output sizes, a too small buffer) are skipped as `too_large` before
/// anything is decoded.
pub fn decode_batch_into(
    samples: &[EncodedSample],
    transform: &Transform,
    limits: &DecodeLimits,
    out: &mut [u8],
) -> DecodedInto {
    let mut planned = PlannedBatch::new(samples, cloned_names(samples), transform, limits);
    planned.fit(out.len());
    planned.decode_into(samples, transform, out)
}

fn cloned_names(samples: &[EncodedSample]) -> Vec<(String, String)> {
    samples
        .iter()
        .map(|s| (s.key.clone(), s.metadata.clone()))
        .collect()
}

/// A batch decoded for a reply: its pixels in a buffer of a [`PixelPool`], shared as
/// [`Bytes`] (into the gRPC reply without a copy; back to the pool when the reply is gone).
#[derive(Debug)]
pub struct PooledBatch {
    pub pixels: Bytes,
    pub samples: Vec<SampleMeta>,
    pub timings: BatchTimings,
}

impl PooledBatch {
    pub fn decoded_count(&self) -> usize {
        self.samples.iter().filter(|s| s.skip.is_none()).count()
    }
}

/// [`decode_batch`] for a reply: the samples' keys and metadata are moved, not copied, and the
/// pixels go to a buffer taken from `pool` (no allocation and no zeroing once the pool holds
/// buffers of the batch's size).
pub fn decode_batch_pooled(
    mut samples: Vec<EncodedSample>,
    transform: &Transform,
    limits: &DecodeLimits,
    pool: &Arc<PixelPool>,
) -> PooledBatch {
    let names = samples
        .iter_mut()
        .map(|s| (std::mem::take(&mut s.key), std::mem::take(&mut s.metadata)))
        .collect();
    let planned = PlannedBatch::new(&samples, names, transform, limits);
    let need = planned.bytes();
    let mut buf = pool.take(need);
    let into = planned.decode_into(&samples, transform, &mut buf[..need]);
    PooledBatch {
        pixels: Bytes::from_owner(PooledPixels {
            buf,
            len: into.bytes,
            pool: pool.clone(),
        }),
        samples: into.samples,
        timings: into.timings,
    }
}

/// Batch pixel buffers, reused from batch to batch: a steady stream of batches of one shape
/// costs no allocation, no page faults on fresh memory and no zeroing (every byte handed out
/// is overwritten by the decode). Holds at most `keep` idle buffers.
#[derive(Debug)]
pub struct PixelPool {
    idle: Mutex<Vec<Vec<u8>>>,
    keep: usize,
    allocations: AtomicU64,
}

impl PixelPool {
    pub fn new(keep: usize) -> Arc<Self> {
        Arc::new(Self {
            idle: Mutex::new(Vec::new()),
            keep: keep.max(1),
            allocations: AtomicU64::new(0),
        })
    }

    /// Buffers allocated so far (a batch larger than every idle buffer needs one).
    pub fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }

    /// A buffer of at least `len` bytes: the smallest idle one that holds it, else a new one.
    fn take(&self, len: usize) -> Vec<u8> {
        let found = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            best.map(|i| idle.swap_remove(i))
        };
        found.unwrap_or_else(|| {
            self.allocations.fetch_add(1, Ordering::Relaxed);
            // calloc: fresh zero pages from the kernel, not a memset.
            vec![0u8; len]
        })
    }

    fn put(&self, buf: Vec<u8>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.keep {
            idle.push(buf);
        } else if let Some(smallest) = idle.iter_mut().min_by_key(|b| b.len())
            && smallest.len() < buf.len()
        {
            // Keep the larger buffers: they serve every batch size.
            *smallest = buf;
        }
    }
}

/// The owner behind a [`PooledBatch`]'s `Bytes`: returns its buffer to the pool on drop.
struct PooledPixels {
    buf: Vec<u8>,
    len: usize,
    pool: Arc<PixelPool>,
}

impl AsRef<[u8]> for PooledPixels {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for PooledPixels {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.buf));
    }
}

/// Pass 1 of a batch: every header probed, every output's shape and offset known.
struct PlannedBatch {
    plans: Vec<Result<Plan, SkipReason>>,
    metas: Vec<SampleMeta>,
    started: Instant,
}

impl PlannedBatch {
    /// `names` are the samples' (key, metadata), moved into the metadata of the result.
    fn new(
        samples: &[EncodedSample],
        names: Vec<(String, String)>,
        transform: &Transform,
        limits: &DecodeLimits,
    ) -> Self {
        let started = Instant::now();
        let plans: Vec<Result<Plan, SkipReason>> = samples
            .par_iter()
            .zip(names.par_iter())
            .map(|(s, (key, _))| plan_sample(key, s, transform, limits))
            .collect();
        let metas = samples
            .iter()
            .zip(names)
            .zip(&plans)
            .map(|((s, (key, metadata)), p)| {
                let mut m = SampleMeta {
                    key,
                    metadata,
                    encoded_bytes: s.data.as_ref().map_or(0, |b| b.len() as u64),
                    ..SampleMeta::default()
                };
                match p {
                    Ok(plan) => {
                        let (ow, oh) = plan.probe.oriented_size();
                        m.orig_width = ow;
                        m.orig_height = oh;
                        m.width = plan.out.0;
                        m.height = plan.out.1;
                    }
                    Err(reason) => m.skip = Some(*reason),
                }
                m
            })
            .collect();
        let mut planned = Self {
            plans,
            metas,
            started,
        };
        planned.lay_out();
        planned
    }

    /// Sample after sample, back to back.
    fn lay_out(&mut self) {
        let mut offset = 0u64;
        for m in &mut self.metas {
            m.offset = offset;
            offset += m.byte_len() as u64;
        }
    }

    fn bytes(&self) -> usize {
        self.metas.iter().map(SampleMeta::byte_len).sum()
    }

    /// Skips, as `too_large`, the samples that would end past `capacity` bytes.
    fn fit(&mut self, capacity: usize) {
        let mut end = 0usize;
        for (m, plan) in self.metas.iter_mut().zip(&mut self.plans) {
            if m.skip.is_some() {
                continue;
            }
            if end + m.byte_len() > capacity {
                tracing::warn!(key = %m.key, capacity, "sample does not fit in the batch buffer; skipping");
                m.skip = Some(SkipReason::TooLarge);
                m.width = 0;
                m.height = 0;
                *plan = Err(SkipReason::TooLarge);
                continue;
            }
            end += m.byte_len();
        }
        self.lay_out();
    }

    /// Passes 2 and 3: every sample decoded into its own slice of `out`, then the holes left
    /// by late failures closed. `out` holds at least [`PlannedBatch::bytes`].
    fn decode_into(
        self,
        samples: &[EncodedSample],
        transform: &Transform,
        out: &mut [u8],
    ) -> DecodedInto {
        let Self {
            plans,
            mut metas,
            started,
        } = self;
        let t1 = Instant::now();
        let mut slots: Vec<&mut [u8]> = Vec::with_capacity(metas.len());
        let mut rest = &mut out[..];
        for m in &metas {
            let (head, tail) = rest.split_at_mut(m.byte_len());
            slots.push(head);
            rest = tail;
        }
        let results: Vec<(Result<(), SkipReason>, Duration, Duration)> = slots
            .into_par_iter()
            .zip(samples.par_iter())
            .zip(plans.par_iter())
            .zip(metas.par_iter())
            .map(
                |(((slot, sample), plan), meta)| match (plan, &sample.data) {
                    (Ok(plan), Ok(data)) => decode_into(&meta.key, data, plan, transform, slot),
                    _ => (Ok(()), Duration::ZERO, Duration::ZERO),
                },
            )
            .collect();
        let t2 = Instant::now();

        let mut timings = BatchTimings::default();
        for (m, (r, dec, res)) in metas.iter_mut().zip(&results) {
            timings.decode_cpu += *dec;
            timings.resize_cpu += *res;
            if let Err(reason) = r {
                m.skip = Some(*reason);
            }
        }
        let mut write = 0usize;
        for m in &mut metas {
            if m.skip.is_some() {
                m.width = 0;
                m.height = 0;
                m.offset = write as u64;
                continue;
            }
            let len = m.byte_len();
            let read = m.offset as usize;
            if read != write {
                out.copy_within(read..read + len, write);
            }
            m.offset = write as u64;
            write += len;
        }
        timings.probe_wall = t1 - started;
        timings.decode_wall = t2 - t1;
        timings.pack_wall = t1 - started + t2.elapsed();
        DecodedInto {
            samples: metas,
            timings,
            bytes: write,
        }
    }
}

fn plan_sample(
    key: &str,
    s: &EncodedSample,
    transform: &Transform,
    limits: &DecodeLimits,
) -> Result<Plan, SkipReason> {
    let data = s.data.as_ref().map_err(|r| *r)?;
    let probe = decode::probe(data, limits).map_err(|e| {
        tracing::warn!(key, reason = %e.category(), error = %e, "skipping sample");
        e.category()
    })?;
    let (w, h) = probe.oriented_size();
    let out = transform.output_size(w, h).map_err(|e| {
        tracing::warn!(key, reason = "bad_geometry", error = %e, "skipping sample");
        SkipReason::BadGeometry
    })?;
    Ok(Plan { probe, out })
}

/// Decodes one sample and resizes it into `slot`; returns (result, decode time, resize time).
fn decode_into(
    key: &str,
    data: &[u8],
    plan: &Plan,
    transform: &Transform,
    slot: &mut [u8],
) -> (Result<(), SkipReason>, Duration, Duration) {
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let scratch = &mut *guard;
        let t0 = thread_cpu_time();
        let (ow, oh) = plan.probe.oriented_size();
        let orientation = plan.probe.orientation;
        let min = match transform.min_source_size(ow, oh) {
            Ok((mw, mh)) if orientation.swaps_axes() => Some((mh, mw)),
            Ok(m) => Some(m),
            Err(_) => None,
        };
        // The window is found on the oriented image; the decoder wants it in stored pixels.
        let window = transform
            .source_window(ow, oh)
            .map(|r| orientation.inverse().map_rect(r, ow, oh));
        let decoded = match decode::decode_rgb(data, &plan.probe, min, window, &mut scratch.decoded)
        {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(key, reason = %e.category(), error = %e, "skipping sample");
                return (
                    Err(e.category()),
                    thread_cpu_time().saturating_sub(t0),
                    Duration::ZERO,
                );
            }
        };
        let full = (decoded.full_width, decoded.full_height);
        let region = orientation.map_rect(decoded.rect(), full.0, full.1);
        let full = if orientation.swaps_axes() {
            (full.1, full.0)
        } else {
            full
        };
        let pixels = &scratch.decoded[..decoded.byte_len()];
        let src = if orientation == decode::Orientation::Normal {
            pixels
        } else {
            decode::apply_orientation(
                pixels,
                decoded.width,
                decoded.height,
                orientation,
                &mut scratch.oriented,
            );
            &scratch.oriented[..]
        };
        let t1 = thread_cpu_time();
        let result =
            transform.apply_region(src, region, full, plan.out, slot, &mut scratch.resampler);
        let t2 = thread_cpu_time();
        match result {
            Ok(()) => (Ok(()), t1.saturating_sub(t0), t2.saturating_sub(t1)),
            Err(e) => {
                tracing::warn!(key, reason = "bad_geometry", error = %e, "skipping sample");
                (
                    Err(SkipReason::BadGeometry),
                    t1.saturating_sub(t0),
                    t2.saturating_sub(t1),
                )
            }
        }
    })
}

/// CPU time of the calling thread. Per-sample stage times use it rather than wall time: on a
/// shared node, wall time would count other processes' slices as our decode time.
pub fn thread_cpu_time() -> Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of the whole process, all threads (the profile's GET stage runs on several).
pub fn process_cpu_time() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass; both CPU-time clocks exist on
    // every Linux the loader runs on.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Orientation, apply_orientation};
    use turbojpeg::Subsamp;

    /// Gradients, hard edges and noise: enough detail that a misplaced or misscaled window
    /// shows up as a large error.
    fn photo_like(w: u32, h: u32, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut out = Vec::with_capacity((w * h * 3) as usize);
        for y in 0..h {
            for x in 0..w {
                let stripe = if (x / 7 + y / 11) % 2 == 0 { 60 } else { 0 };
                let r = (x * 180 / w) + stripe + rng.u32(0..16);
                let g = (y * 180 / h) + rng.u32(0..16);
                let b = ((x + 2 * y) % 97) * 2 + rng.u32(0..16);
                out.extend_from_slice(&[r.min(255) as u8, g.min(255) as u8, b.min(255) as u8]);
            }
        }
        out
    }

    fn jpeg(w: u32, h: u32, subsamp: Subsamp, orientation: u16) -> Vec<u8> {
        let rgb = photo_like(w, h, u64::from(w * 31 + h));
        let img = turbojpeg::Image {
            pixels: rgb.as_slice(),
            width: w as usize,
            pitch: w as usize * 3,
            height: h as usize,
            format: turbojpeg::PixelFormat::RGB,
        };
        let jpeg = turbojpeg::compress(img, 90, subsamp).unwrap().to_vec();
        if orientation == 1 {
            return jpeg;
        }
        // APP1 right after SOI: big-endian TIFF, IFD0 with one entry, 0x0112 SHORT.
        let mut tiff = b"MM\0\x2a\0\0\0\x08\0\x01".to_vec();
        tiff.extend_from_slice(&[0x01, 0x12, 0, 3, 0, 0, 0, 1]);
        tiff.extend_from_slice(&orientation.to_be_bytes());
        tiff.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        let mut out = jpeg[..2].to_vec();
        out.extend_from_slice(&[0xFF, 0xE1]);
        out.extend_from_slice(&((2 + 6 + tiff.len()) as u16).to_be_bytes());
        out.extend_from_slice(b"Exif\0\0");
        out.extend_from_slice(&tiff);
        out.extend_from_slice(&jpeg[2..]);
        out
    }

    /// The path before crop windows: the whole image decoded (same DCT scale), oriented,
    /// then resized and cropped.
    fn full_decode_output(data: &[u8], t: &Transform) -> (Vec<u8>, (u32, u32)) {
        let probe = decode::probe(data, &DecodeLimits::default()).unwrap();
        let (ow, oh) = probe.oriented_size();
        let (mw, mh) = t.min_source_size(ow, oh).unwrap();
        let min = if probe.orientation.swaps_axes() {
            (mh, mw)
        } else {
            (mw, mh)
        };
        let mut buf = Vec::new();
        let d = decode::decode_rgb(data, &probe, Some(min), None, &mut buf).unwrap();
        assert_eq!((d.width, d.height), (d.full_width, d.full_height));
        let mut oriented = Vec::new();
        let (sw, sh) = apply_orientation(
            &buf[..d.byte_len()],
            d.width,
            d.height,
            probe.orientation,
            &mut oriented,
        );
        let out = t.output_size(ow, oh).unwrap();
        let mut dst = vec![0u8; (out.0 * out.1 * 3) as usize];
        t.apply(&oriented, sw, sh, out, &mut dst, &mut Resampler::default())
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

    /// Decoding only the crop window gives the output of the whole-image path: same shapes,
    /// PSNR of at least 40 dB (in practice identical but for window-edge pixels), over sizes
    /// that scale by 1, 1/2 and 1/4, odd sizes, every subsampling and every EXIF orientation.
    #[test]
    fn crop_window_matches_full_decode() {
        const SUBSAMPS: [Subsamp; 7] = [
            Subsamp::Sub2x2,
            Subsamp::None,
            Subsamp::Sub2x1,
            Subsamp::Gray,
            Subsamp::Sub1x2,
            Subsamp::Sub4x1,
            Subsamp::Sub1x4,
        ];
        let sizes = [
            (500, 375),
            (375, 500),
            (500, 333),
            (1600, 1200),
            (1200, 1600),
            (1023, 767),
            (641, 479),
            (999, 1001),
            (2001, 601),
            (3001, 2001),
            (449, 449),
        ];
        let targets = [(448, 448), (224, 160), (96, 300)];
        let mut cases = Vec::new();
        for (i, &(w, h)) in sizes.iter().enumerate() {
            cases.push((
                w,
                h,
                SUBSAMPS[i % 7],
                1 + (i as u16 * 3) % 8,
                targets[i % 3],
            ));
        }
        for (i, s) in SUBSAMPS.into_iter().enumerate() {
            cases.push((1600, 1200, s, 1, targets[i % 3]));
        }
        for o in 1..=8 {
            cases.push((1023, 767, Subsamp::Sub2x2, o, (448, 448)));
            cases.push((641, 479, Subsamp::Sub2x1, o, (224, 160)));
        }
        let mut worst = f64::INFINITY;
        for (w, h, subsamp, orientation, (tw, th)) in cases {
            let what = format!("{w}x{h} {subsamp:?} orientation {orientation} -> {tw}x{th}");
            let data = jpeg(w, h, subsamp, orientation);
            let t = Transform::Crop {
                width: tw,
                height: th,
            };
            let (want, shape) = full_decode_output(&data, &t);
            let sample = EncodedSample {
                key: what.clone(),
                metadata: String::new(),
                data: Ok(Bytes::from(data.clone())),
            };
            let batch = decode_batch(&[sample], &t, &DecodeLimits::default());
            let m = &batch.samples[0];
            assert_eq!(m.skip, None, "{what}");
            assert_eq!((m.width, m.height), shape, "{what}");
            let p = psnr(batch.sample_pixels(0), &want);
            assert!(p >= 40.0, "{what}: PSNR {p:.1} dB");
            worst = worst.min(p);
        }
        eprintln!("worst PSNR against the full decode: {worst:.1} dB");
    }

    /// The window really is all that is decoded: a 1600x1200 4:2:0 JPEG cropped to 448x448
    /// decodes at 1/2 scale, 607 of its 800 columns (the 600 of the box, the filter's margin
    /// and the iMCU alignment).
    #[test]
    fn crop_window_decodes_fewer_pixels() {
        let data = jpeg(1600, 1200, Subsamp::Sub2x2, 1);
        let probe = decode::probe(&data, &DecodeLimits::default()).unwrap();
        let t = Transform::Crop {
            width: 448,
            height: 448,
        };
        let window = t.source_window(1600, 1200);
        let min = t.min_source_size(1600, 1200).ok();
        let mut buf = Vec::new();
        let d = decode::decode_rgb(&data, &probe, min, window, &mut buf).unwrap();
        assert_eq!((d.full_width, d.full_height), (800, 600));
        assert_eq!((d.x, d.y, d.width, d.height), (96, 0, 607, 600));
        assert_eq!(d.byte_len(), 607 * 600 * 3);
        assert_eq!(Orientation::Normal.map_rect(d.rect(), 800, 600), d.rect());
    }
}
