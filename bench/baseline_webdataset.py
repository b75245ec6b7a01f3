"""The baseline for shards: a PyTorch DataLoader over the `webdataset` package, the way its
documentation reads shards from S3 (a `pipe:` URL per shard streaming the whole object, here
with curl's SigV4 signing), Pillow decode, shorter side to 448 and a 448x448 centre crop, in
`--workers` processes (shards split over them). Prints images/s (JSON with --json).
"""

import argparse
import json
import os
import time

import torch
import webdataset as wds

from baseline_dataloader import crop_tensor, list_keys


def main():
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
    torch.set_num_threads(1)
    keys = [k for k in list_keys(args.endpoint, args.bucket, args.prefix) if k.endswith(".tar")]
    user = f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}"
    urls = [
        f"pipe:curl -s --fail --aws-sigv4 aws:amz:us-east-1:s3 --user {user} "
        f"{args.endpoint}/{args.bucket}/{k}"
        for k in keys
    ]
    size = args.size
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, workersplitter=wds.split_by_worker,
                       nodesplitter=wds.single_node_only)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(lambda img: crop_tensor(img, size), lambda label: label)
        .batched(args.batch_size, partial=True)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers,
                           persistent_workers=args.workers > 0)
    seen, t0 = 0, None
    for _ in range(args.epochs):
        for i, (images, _labels) in enumerate(loader):
            if t0 is None and i + 1 >= args.warmup:
                t0 = time.perf_counter()
                continue
            if t0 is not None:
                seen += images.shape[0]
    secs = time.perf_counter() - t0
    rate = seen / secs
    if args.json:
        print(json.dumps({"images": seen, "seconds": secs, "images_per_second": rate,
                          "workers": args.workers, "shards": len(keys)}))
    else:
        print(f"webdataset baseline: {seen} images in {secs:.2f} s = {rate:.1f} images/s "
              f"({args.workers} workers, {len(keys)} shards)")


if __name__ == "__main__":
    main()
