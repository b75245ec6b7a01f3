"""Real processes for the client tests: the `stoker-s3` test server and `stoker-loader`
(decode workers and the sidecar), built by `cargo build -p stoker-loader` and
`cargo build -p stoker-testenv --bin stoker-s3`. Images are PNGs written by a tiny encoder
(zlib only), so the tests need nothing beyond numpy and pytest.
"""

import os
import pathlib
import signal
import struct
import subprocess
import threading
import zlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
BUCKET = "data"
ACCESS_KEY = "stoker-test-access"
SECRET_KEY = "stoker-test-secret"


def _binary(env: str, name: str) -> str:
    path = os.environ.get(env) or str(REPO / "target" / "debug" / name)
    if not os.path.exists(path):
        pytest.fail("%s not found at %s: build it first or set %s" % (name, path, env))
    return path


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG with a gradient that depends on `seed`."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y + seed * 37) % 256], -1)
    raw = b"".join(b"\x00" + row.astype(np.uint8).tobytes() for row in rgb)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


class Proc:
    """A child process whose first stdout line announces its addresses; killed on stop."""

    def __init__(self, args, env=None):
        full_env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "STOKER_SOCKET", "STOKER_SHM_DIR", "AWS_PROFILE"):
            full_env.pop(k, None)
        full_env.update(
            {
                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_EC2_METADATA_DISABLED": "true",
                "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
            }
        )
        full_env.update(env or {})
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, env=full_env)
        self.line = self.p.stdout.readline().decode()
        if "listening" not in self.line:
            self.p.kill()
            raise RuntimeError("%s did not start: %r" % (args[0], self.line))
        # Drain stdout so the child never blocks on a full pipe.
        threading.Thread(target=self.p.stdout.read, daemon=True).start()

    def field(self, name: str) -> str:
        for word in self.line.split():
            if word.startswith(name + "="):
                return word[len(name) + 1 :]
        raise KeyError(name)

    def kill9(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait()


class Env:
    def __init__(self, tmp: pathlib.Path):
        self.tmp = tmp
        self.root = tmp / "s3"
        (self.root / BUCKET).mkdir(parents=True)
        self.loader = _binary("STOKER_LOADER_BIN", "stoker-loader")
        self.procs = []
        s3 = self._start([_binary("STOKER_S3_BIN", "stoker-s3"), "--root", str(self.root), "--port", "0"])
        self.endpoint = s3.line.strip().split()[-1]
        self.keys = []

    def _start(self, args, env=None):
        p = Proc(args, env)
        self.procs.append(p)
        return p

    def put(self, key: str, data: bytes):
        (self.root / BUCKET / key).write_bytes(data)

    def dataset(self, n: int, width: int = 80, height: int = 60):
        for i in range(n):
            key = "img-%04d.png" % i
            self.put(key, png(width, height, i))
            self.keys.append(key)
        return list(self.keys)

    def s3_flags(self):
        return ["--endpoint", self.endpoint, "--region", "us-east-1", "--force-path-style", "--max-attempts", "3"]

    def decode_worker(self):
        p = self._start(
            [self.loader, "decode", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--threads", "1"]
            + self.s3_flags()
        )
        return p.field("grpc")

    def sidecar(self, *extra, workers=()):
        shm = self.tmp / ("shm-%d" % len(self.procs))
        shm.mkdir()
        args = [self.loader, "sidecar", "--bucket", BUCKET, "--http-addr", "127.0.0.1:0"]
        args += ["--shm-dir", str(shm), "--local-decoders", "1"] + list(extra) + self.s3_flags()
        if workers:
            args += ["--workers", ",".join(workers)]
        p = self._start(args)
        p.socket = p.field("socket")
        return p

    def stop(self):
        for p in reversed(self.procs):
            p.kill9()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.stop()
