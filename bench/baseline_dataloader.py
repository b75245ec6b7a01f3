"""The baseline users write: a PyTorch DataLoader (num_workers = cores) over a map-style dataset
that GETs each object with boto3, decodes it with Pillow, resizes the shorter side to 448 and
center-crops 448x448, returning uint8 HWC tensors. Prints images/s (JSON with --json).
"""

import argparse
import io
import json
import os
import time

import boto3
import numpy as np
import torch
from botocore.config import Config
from PIL import Image


class S3ImageDataset(torch.utils.data.Dataset):
    def __init__(self, endpoint, bucket, keys, size):
        self.endpoint, self.bucket, self.keys, self.size = endpoint, bucket, keys, size
        self.s3 = None  # one client per worker process, made lazily after fork

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if self.s3 is None:
            self.s3 = boto3.client(
                "s3", endpoint_url=self.endpoint, region_name="us-east-1",
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10}),
            )
        body = self.s3.get_object(Bucket=self.bucket, Key=self.keys[i])["Body"].read()
        return crop_tensor(Image.open(io.BytesIO(body)), self.size)


def crop_tensor(img, size):
    """Shorter side to `size` (bilinear), then the centre `size` x `size`, as uint8 HWC."""
    img = img.convert("RGB")
    w, h = img.size
    s = size / min(w, h)
    nw, nh = max(size, round(w * s)), max(size, round(h * s))
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    img = img.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.asarray(img).copy())


def list_keys(endpoint, bucket, prefix):
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}))
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def parse_args():
    """The options both baselines take: where the images are, workers, batch and crop size."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--prefix", default="")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4, help="batches not timed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    return args


def main():
    args = parse_args()
    torch.set_num_threads(1)
    keys = list_keys(args.endpoint, args.bucket, args.prefix)
    ds = S3ImageDataset(args.endpoint, args.bucket, keys, args.size)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=args.batch_size, num_workers=args.workers, shuffle=False,
        persistent_workers=args.workers > 0,
    )
    seen, t0 = 0, None
    for _ in range(args.epochs):
        for i, batch in enumerate(loader):
            if t0 is None and i + 1 >= args.warmup:
                t0 = time.perf_counter()
                continue
            if t0 is not None:
                seen += batch.shape[0]
    secs = time.perf_counter() - t0
    rate = seen / secs
    if args.json:
        print(json.dumps({"images": seen, "seconds": secs, "images_per_second": rate,
                          "workers": args.workers}))
    else:
        print(f"baseline: {seen} images in {secs:.2f} s = {rate:.1f} images/s ({args.workers} workers)")


if __name__ == "__main__":
    main()
