"""A simulated trainer: a fixed "GPU" step time per batch, fed by the stoker sidecar, by loading
its own batches synchronously (the baseline most jobs start from), or by a PyTorch DataLoader
with worker processes on its own node (what most jobs try next; needs torch).

Each second it appends one JSON line to --report: samples so far, compute and data-wait seconds
in the last interval, and GPU busy % = compute time / wall time. With --keys-out it records every
delivered key (one per line, per epoch), so a test can check that each sample arrived once.

  python trainer.py --mode sidecar --step-ms 60 --report /tmp/r.jsonl
  python trainer.py --mode sync --endpoint http://10.213.31.1:9000 --bucket demo --step-ms 60
  python trainer.py --mode dataloader --workers 4 --endpoint http://10.213.31.1:9000 --bucket demo
"""

import argparse
import io
import json
import os
import sys
import time


class Meter:
    """Compute and wait seconds per reporting interval, written as JSON lines."""

    def __init__(self, path, interval=1.0):
        self.path = path
        self.interval = interval
        self.samples = 0
        self.compute = self.wait = 0.0
        self.mark = time.monotonic()
        self.start = self.mark

    def add(self, samples, compute_s, wait_s):
        self.samples += samples
        self.compute += compute_s
        self.wait += wait_s
        now = time.monotonic()
        if now - self.mark >= self.interval:
            self.flush(now)

    def flush(self, now):
        wall = now - self.mark
        line = {
            "t": round(now - self.start, 2),
            "samples": self.samples,
            "busy_pct": round(100 * self.compute / wall, 1),
            "wait_pct": round(100 * self.wait / wall, 1),
        }
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        self.compute = self.wait = 0.0
        self.mark = now


def sidecar_batches(args):
    import stoker

    client = stoker.Client()
    epoch = 0
    while args.epochs == 0 or epoch < args.epochs:
        for batch in stoker.batches(client):
            keys = list(batch.keys)
            skips = list(batch.skips)
            batch.release()
            yield epoch, keys, skips
        epoch += 1


def s3_client(args):
    import boto3

    return boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1")


def list_keys(s3, args):
    keys, token = [], None
    while True:
        kw = {"Bucket": args.bucket, "Prefix": args.prefix}
        if token:
            kw["ContinuationToken"] = token
        page = s3.list_objects_v2(**kw)
        keys += [o["Key"] for o in page.get("Contents", [])]
        token = page.get("NextContinuationToken")
        if not token:
            break
    return keys


def load(s3, args, key):
    """GET, decode, resize the short side to --size and center-crop: the pixels, HWC RGB."""
    from PIL import Image

    body = s3.get_object(Bucket=args.bucket, Key=key)["Body"].read()
    im = Image.open(io.BytesIO(body)).convert("RGB")
    w, h = im.size
    scale = args.size / min(w, h)
    im = im.resize((max(args.size, round(w * scale)), max(args.size, round(h * scale))))
    left, top = (im.width - args.size) // 2, (im.height - args.size) // 2
    return im.crop((left, top, left + args.size, top + args.size))


def sync_batches(args):
    """What a trainer does without a loader: list, GET, decode and resize in its own loop."""
    s3 = s3_client(args)
    keys = list_keys(s3, args)
    epoch = 0
    while args.epochs == 0 or epoch < args.epochs:
        for i in range(0, len(keys) - args.batch_size + 1, args.batch_size):
            batch, skips = [], []
            for key in keys[i : i + args.batch_size]:
                try:
                    load(s3, args, key).tobytes()
                    batch.append(key)
                except Exception as exc:  # a bad image is skipped, as stoker does
                    skips.append((key, type(exc).__name__))
            yield epoch, batch, skips
        epoch += 1


class S3Images:
    """A map-style dataset of the bucket's images for a DataLoader (module level: workers may be
    started by pickling it)."""

    def __init__(self, args, keys):
        self.args, self.keys, self.s3 = args, keys, None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        import numpy as np
        import torch

        if self.s3 is None:  # one client per worker process
            self.s3 = s3_client(self.args)
        key = self.keys[i]
        try:
            return key, torch.from_numpy(np.array(load(self.s3, self.args, key))), None
        except Exception as exc:  # a bad image is skipped, as stoker does
            return key, None, type(exc).__name__


def collate(items):
    """(keys, stacked uint8 pixels, skips) of one batch."""
    import torch

    pixels = [p for _, p, _ in items if p is not None]
    return (
        [k for k, p, _ in items if p is not None],
        torch.stack(pixels) if pixels else None,
        [(k, r) for k, p, r in items if p is None],
    )


def dataloader_batches(args):
    """The loader most trainers try next: a PyTorch DataLoader whose --workers processes GET,
    decode and resize on the trainer's own node; shuffled batches of uint8 tensors."""
    from torch.utils.data import DataLoader

    loader = DataLoader(
        S3Images(args, list_keys(s3_client(args), args)),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=True,
        prefetch_factor=4,
        collate_fn=collate,
    )
    epoch = 0
    while args.epochs == 0 or epoch < args.epochs:
        for keys, _pixels, skips in loader:
            yield epoch, keys, skips
        epoch += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sidecar", "sync", "dataloader"], default="sidecar")
    ap.add_argument("--step-ms", type=float, default=60.0, help="simulated GPU time per batch")
    ap.add_argument("--epochs", type=int, default=0, help="0: until stopped")
    ap.add_argument("--report", default=os.environ.get("STOKER_SIM_REPORT"))
    ap.add_argument("--keys-out", default=os.environ.get("STOKER_SIM_KEYS"))
    ap.add_argument("--endpoint", default=os.environ.get("STOKER_S3_ENDPOINT"))
    ap.add_argument("--bucket", default=os.environ.get("STOKER_S3_BUCKET", "demo"))
    ap.add_argument("--prefix", default="")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=4, help="DataLoader worker processes")
    args = ap.parse_args()

    meter = Meter(args.report)
    batches = {"sidecar": sidecar_batches, "sync": sync_batches, "dataloader": dataloader_batches}[args.mode](args)
    keys_out = open(args.keys_out, "a") if args.keys_out else None
    waited_from = time.monotonic()
    for epoch, keys, skips in batches:
        wait_s = time.monotonic() - waited_from
        if keys_out:
            keys_out.write("".join("%d %s\n" % (epoch, k) for k in keys))
            keys_out.write("".join("%d %s skip:%s\n" % (epoch, k, r) for k, r in skips))
            keys_out.flush()
        started = time.monotonic()
        time.sleep(args.step_ms / 1000)  # the GPU step
        meter.add(len(keys), time.monotonic() - started, wait_s)
        waited_from = time.monotonic()
    meter.flush(time.monotonic())
    return 0


if __name__ == "__main__":
    sys.exit(main())
