"""Builds the decode benchmark's datasets from scikit-image's bundled sample photographs.

(a) mixed: >= 1,000 distinct photos of 500x375 .. 1600x1200 (random crops, flips, scales and
    tone shifts of the samples), ~90% JPEG, 6% PNG, 4% WebP.
(b) imagenet: ImageNet-sized JPEGs (500x375, 500x333, 375x500, 500x500, ... at quality 95, ~110 KB each like ImageNet).

Files are written straight under ROOT/BUCKET/, which the s3s-fs test server serves as objects.
"""

import argparse
import io
import os
import random

import numpy as np
from PIL import Image, ImageEnhance
import skimage.data as skd

PHOTOS = [
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
    "immunohistochemistry", "camera", "moon", "stereo_motorcycle",
]


def load_photos():
    out = []
    for name in PHOTOS:
        try:
            img = getattr(skd, name)()
        except Exception as exc:  # a sample that needs a download is left out
            print(f"skipping {name}: {exc}")
            continue
        if isinstance(img, tuple):  # stereo_motorcycle returns (left, right, disparity)
            img = img[0]
        img = np.asarray(img)
        if img.dtype != np.uint8:
            img = (255 * (img.astype(np.float64) / max(img.max(), 1))).astype(np.uint8)
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        out.append(Image.fromarray(img[..., :3]))
    return out


def variant(rng, photo, w, h, noise):
    """A distinct image of w x h cut from photo."""
    pw, ph = photo.size
    aspect = w / h
    cw = rng.uniform(0.55, 1.0) * pw
    ch = cw / aspect
    if ch > ph:
        ch = rng.uniform(0.55, 1.0) * ph
        cw = ch * aspect
    x = rng.uniform(0, pw - cw)
    y = rng.uniform(0, ph - ch)
    img = photo.crop((int(x), int(y), int(x + cw), int(y + ch))).resize((w, h), Image.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.8, 1.2))
    img = ImageEnhance.Color(img).enhance(rng.uniform(0.7, 1.3))
    # Sensor-like noise keeps JPEG sizes near real photographs instead of smooth upscales.
    arr = np.asarray(img).astype(np.int16)
    arr += np.random.default_rng(rng.randrange(1 << 30)).normal(0, noise, arr.shape).astype(np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def write(path, img, fmt, quality):
    buf = io.BytesIO()
    if fmt == "jpg":
        img.save(buf, "JPEG", quality=quality)
    elif fmt == "png":
        img.save(buf, "PNG", compress_level=6)
    else:
        img.save(buf, "WEBP", quality=quality)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return len(buf.getvalue())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--set", choices=["mixed", "imagenet"], required=True)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quality", type=int, default=95, help="JPEG quality of the imagenet set")
    ap.add_argument("--noise", type=float, default=None,
                    help="sensor-noise sigma; defaults give ~220 KB per mixed photo and "
                         "~110 KB per ImageNet-sized JPEG, as in the real sets")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    noise = args.noise if args.noise is not None else (2.5 if args.set == "mixed" else 10.0)
    photos = load_photos()
    out_dir = os.path.join(args.root, args.set)
    os.makedirs(out_dir, exist_ok=True)
    total = 0
    for i in range(args.count):
        photo = photos[i % len(photos)]
        if args.set == "mixed":
            w = rng.randint(500, 1600)
            h = int(w * 0.75)
            if rng.random() < 0.25:
                w, h = h, w
            r = rng.random()
            fmt = "jpg" if r < 0.90 else ("png" if r < 0.96 else "webp")
            quality = rng.randint(80, 95)
        else:
            w, h = rng.choice([(500, 375), (500, 333), (375, 500), (500, 500), (500, 400), (333, 500), (400, 300)])
            fmt, quality = "jpg", args.quality
        total += write(os.path.join(out_dir, f"{i:05d}.{fmt}"), variant(rng, photo, w, h, noise), fmt, quality)
    print(f"{args.set}: {args.count} files, {total / args.count / 1e3:.0f} KB average, in {out_dir}")


if __name__ == "__main__":
    main()
