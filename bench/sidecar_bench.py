"""A simulated trainer with a fixed step time, fed three ways; prints its data wait %.

  sync        the trainer GETs (boto3) and decodes (Pillow) its own batch, then steps
  dataloader  PyTorch DataLoader, num_workers = cores, over the same Pillow pipeline
              (bench/baseline_dataloader.py's dataset)
  stoker      the stoker client reading batches from `stoker-loader sidecar` (decode workers)

Data wait = seconds blocked waiting for the next batch / wall seconds, after `--warmup`
batches. For stoker it also reports the hand-off latency: from the later of (slot ready,
request sent) to the trainer holding the numpy view.
"""

import argparse
import io
import json
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pillow_batch(s3, bucket, keys, size):
    from PIL import Image

    out = []
    for k in keys:
        body = s3.get_object(Bucket=bucket, Key=k)["Body"].read()
        img = Image.open(io.BytesIO(body)).convert("RGB")
        w, h = img.size
        s = size / min(w, h)
        nw, nh = max(size, round(w * s)), max(size, round(h * s))
        img = img.resize((nw, nh), Image.BILINEAR)
        left, top = (nw - size) // 2, (nh - size) // 2
        out.append(np.asarray(img.crop((left, top, left + size, top + size))))
    return np.stack(out)


def run(next_batch, args):
    """Steps the simulated trainer; returns the measured numbers."""
    waits, wall0 = [], None
    for i in range(args.warmup + args.batches):
        if i == args.warmup:
            wall0 = time.monotonic()
        t0 = time.monotonic()
        n = next_batch()
        if i >= args.warmup:
            waits.append(time.monotonic() - t0)
        assert n > 0
        time.sleep(args.step_ms / 1000)  # the GPU step: no CPU used
    wall = time.monotonic() - wall0
    return {"data_wait_percent": 100 * sum(waits) / wall, "wall_s": wall, "batches": len(waits),
            "images_per_s": args.batches * args.batch_size / wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sync", "dataloader", "stoker"], required=True)
    ap.add_argument("--endpoint", default="http://127.0.0.1:19000")
    ap.add_argument("--bucket", default="imagenet")
    ap.add_argument("--socket")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--step-ms", type=float, default=50)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args()
    result = {"mode": args.mode, "step_ms": args.step_ms, "batch_size": args.batch_size}

    if args.mode in ("sync", "dataloader"):
        import boto3
        from botocore.config import Config
        from baseline_dataloader import list_keys

        keys = list_keys(args.endpoint, args.bucket, "")
        random.Random(42).shuffle(keys)
    if args.mode == "sync":
        s3 = boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}))
        pos = [0]

        def next_batch():
            ks = [keys[(pos[0] + j) % len(keys)] for j in range(args.batch_size)]
            pos[0] += args.batch_size
            return len(pillow_batch(s3, args.bucket, ks, args.size))
    elif args.mode == "dataloader":
        import torch
        from baseline_dataloader import S3ImageDataset

        ds = S3ImageDataset(args.endpoint, args.bucket, keys, args.size)
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                             num_workers=args.workers, persistent_workers=True,
                                             drop_last=True)
        state = {"it": iter(loader)}

        def next_batch():
            try:
                return len(next(state["it"]))
            except StopIteration:
                state["it"] = iter(loader)
                return len(next(state["it"]))
        result["workers"] = args.workers
    else:
        import stoker

        client = stoker.Client(args.socket, connect_timeout=30)
        handoff = []

        def next_batch():
            while True:
                item = client.next()
                if isinstance(item, stoker.Batch):
                    break
            n = len(item.array)
            handoff.append(item.handoff_ns)
            item.release()
            return n

    result.update(run(next_batch, args))
    if args.mode == "stoker":
        h = np.array(handoff[args.warmup:]) / 1e3
        result["handoff_us_p50"] = float(np.percentile(h, 50))
        result["handoff_us_p99"] = float(np.percentile(h, 99))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
