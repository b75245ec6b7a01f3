#!/usr/bin/env python3
"""usage: scripts/keep-mtimes.py MANIFEST

Gives every tracked file and directory whose content is unchanged since the last run the
modification time it had then, and records this run's contents and times in MANIFEST
(JSON: path -> [sha256, mtime]; a directory, "./path/", is the list of its entries).

Why: CI builds each fresh clone into one cached target directory, and cargo decides whether a
workspace crate is stale by comparing its sources' mtimes with its last build. A clone stamps
every file "now", so without this every stoker crate, test and clippy check is rebuilt on every
run (470 s here) even when nothing changed. Matching on content, not on commit dates, keeps
that correct in any order of commits: a file whose bytes differ keeps the clone's "now" and is
rebuilt.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path


def tracked_files(root):
    """Regular files in the index (symlinks and submodules left out)."""
    out = subprocess.run(["git", "-C", root, "ls-files", "-s", "-z"],
                         check=True, capture_output=True).stdout
    for entry in out.split(b"\0"):
        if not entry:
            continue
        stage, path = entry.split(b"\t", 1)  # "<mode> <object> <stage>\t<path>"
        if not stage.startswith((b"120000", b"160000")):
            yield os.fsdecode(path)


def main():
    manifest = sys.argv[1]
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"],
                          check=True, capture_output=True, text=True).stdout.strip()
    try:
        with open(manifest) as f:
            previous = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        previous = {}
    files = list(tracked_files(root))
    # A directory's content is the list of its entries: build scripts' `rerun-if-changed` on a
    # directory (loader/build.rs: src/proto) compares the directory's own mtime too.
    entries = {}
    for path in files:
        parts = path.split("/")
        for depth in range(len(parts)):
            entries.setdefault("/".join(["."] + parts[:depth]) + "/", set()).add(parts[depth])
    contents = {path: Path(root, path).read_bytes() for path in files}
    contents.update({d: "\n".join(sorted(names)).encode() for d, names in entries.items()})

    current, restored = {}, 0
    for path, content in contents.items():
        full = os.path.join(root, path)
        sha = hashlib.sha256(content).hexdigest()
        old = previous.get(path)
        if old and old[0] == sha:
            os.utime(full, ns=(old[1], old[1]))
            restored += 1
        current[path] = [sha, os.stat(full).st_mtime_ns]
    os.makedirs(os.path.dirname(os.path.abspath(manifest)), exist_ok=True)
    with open(manifest + ".new", "w") as f:
        json.dump(current, f)
    os.replace(manifest + ".new", manifest)
    print(f"[mtimes] {restored} of {len(current)} files and directories unchanged since the "
          "last run", file=sys.stderr)


if __name__ == "__main__":
    main()
