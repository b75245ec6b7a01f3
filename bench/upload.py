"""PUTs every file under a directory into a bucket, keyed by its path below the directory.

The benchmarks serve their data this way rather than from files dropped into the S3 server's
root: s3s-fs (the test server) keeps the ETag of an object it was sent, and otherwise hashes the
whole file on every GET, which would charge each range GET of a shard the MD5 of all of it.
"""

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    s3 = boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}, max_pool_connections=8))
    try:
        s3.create_bucket(Bucket=args.bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    files = [os.path.join(d, f) for d, _, names in os.walk(args.dir) for f in names]

    def put(path):
        with open(path, "rb") as f:
            s3.put_object(Bucket=args.bucket, Key=os.path.relpath(path, args.dir), Body=f.read())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, files))
    print(f"{len(files)} objects into s3://{args.bucket}/")


if __name__ == "__main__":
    main()
