"""The baseline for shards: a PyTorch DataLoader over the `webdataset` package reading each
shard whole as one streamed S3 GET (an `s3://` handler in webdataset's `gopen_schemes`, boto3
underneath, as users register it), Pillow decode, shorter side to 448 and a 448x448 centre
crop, in `--workers` processes (shards split over them). Prints images/s (JSON with --json).
"""

import json
import time

import boto3
import torch
import webdataset as wds
from botocore.config import Config
from webdataset.gopen import gopen_schemes

from baseline_dataloader import crop_tensor, list_keys, parse_args


def s3_handler(endpoint):
    """A `gopen` handler for s3://bucket/key: the object's body as a stream, one client per
    worker process (made after the fork)."""
    client = []

    def gopen_s3(url, mode="rb", bufsize=8192, **_kw):
        if not client:
            client.append(boto3.client(
                "s3", endpoint_url=endpoint, region_name="us-east-1",
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10}),
            ))
        bucket, key = url[len("s3://"):].split("/", 1)
        return client[0].get_object(Bucket=bucket, Key=key)["Body"]

    return gopen_s3


def main():
    args = parse_args()
    torch.set_num_threads(1)
    keys = [k for k in list_keys(args.endpoint, args.bucket, args.prefix) if k.endswith(".tar")]
    gopen_schemes["s3"] = s3_handler(args.endpoint)
    urls = [f"s3://{args.bucket}/{k}" for k in keys]
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
