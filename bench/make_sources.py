"""Writes one set of images as the three kinds of source scripts/bench-sources.sh compares, each
image with a caption and a label:

  objects/  one object per image (the images themselves)
  shards/   WebDataset tar shards, by the webdataset package's TarWriter
  parquet/  Parquet files by pyarrow, images in Hugging Face's `image` struct (bytes, path), one
            row group per file and data pages of `--page-size` bytes (write_batch_size=1, so
            pages can end after any row), otherwise pyarrow's defaults (snappy, dictionary
            encoding until the dictionary passes 1 MiB)
"""

import argparse
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="a directory of images")
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--page-size", type=int, default=256 * 1024)
    args = ap.parse_args()
    names = sorted(n for n in os.listdir(args.src) if not n.startswith("."))
    for kind in ("objects", "shards", "parquet"):
        os.makedirs(os.path.join(args.out, kind), exist_ok=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for s in range(0, len(names), args.per_shard):
        part = names[s:s + args.per_shard]
        shard = s // args.per_shard
        rows = {"image": [], "caption": [], "label": []}
        with wds.TarWriter(os.path.join(args.out, "shards", f"{shard:05d}.tar")) as tar:
            for i, name in enumerate(part):
                data = open(os.path.join(args.src, name), "rb").read()
                stem, ext = os.path.splitext(name)
                ext = ext.lstrip(".").lower().replace("jpeg", "jpg")
                caption, label = f"photo {s + i}: {stem}", (s + i) % 1000
                try:
                    os.link(os.path.join(args.src, name), os.path.join(args.out, "objects", name))
                except OSError:
                    shutil.copy(os.path.join(args.src, name), os.path.join(args.out, "objects", name))
                tar.write({"__key__": stem, ext: data, "txt": caption, "cls": label})
                rows["image"].append({"bytes": data, "path": name})
                rows["caption"].append(caption)
                rows["label"].append(label)
        table = pa.table({
            "image": pa.array(rows["image"], type=image_type),
            "caption": rows["caption"],
            "label": rows["label"],
        })
        pq.write_table(table, os.path.join(args.out, "parquet", f"{shard:05d}.parquet"),
                       row_group_size=len(part), data_page_size=args.page_size,
                       write_batch_size=1)
    print(f"{len(names)} images in {(len(names) + args.per_shard - 1) // args.per_shard} "
          f"shards and Parquet files under {args.out}")


if __name__ == "__main__":
    main()
