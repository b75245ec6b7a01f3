"""Real processes for the client tests: the `stoker-s3` test server and `stoker-loader`
(decode workers and the sidecar), built by `cargo build -p stoker-loader` and
`cargo build -p stoker-testenv --bin stoker-s3`, and trainer processes (`trainer_proc.py`)
that use the client as torchrun's workers do. Images are PNGs written by a tiny encoder
(zlib only), so the tests need nothing beyond numpy and pytest (transformers for the Qwen
reference).
"""

import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
CLIENT_SRC = REPO / "clients" / "python" / "src"
TRAINER = pathlib.Path(__file__).resolve().parent / "trainer_proc.py"
# The tests exercise this checkout's client, not a copy installed in the venv.
sys.path.insert(0, str(CLIENT_SRC))
BUCKET = "data"
ACCESS_KEY = "stoker-test-access"
SECRET_KEY = "stoker-test-secret"


def _binary(env: str, name: str) -> str:
    path = os.environ.get(env) or str(REPO / "target" / "debug" / name)
    if not os.path.exists(path):
        pytest.fail("%s not found at %s: build it first or set %s" % (name, path, env))
    return path


def png_pixels(width: int, height: int, seed: int) -> np.ndarray:
    """The pixels `png(width, height, seed)` encodes, as (height, width, 3) uint8."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y + seed * 37) % 256], -1)
    return rgb.astype(np.uint8)


def photo_pixels(width: int, height: int, seed: int) -> np.ndarray:
    """Photo-like (height, width, 3) uint8: smooth shading, edges, fine texture and noise, so
    that two resize filters differ as they do on real images (on a gradient they agree)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        fx, fy = rng.uniform(0.002, 0.02, 2)
        smooth = 110 + 70 * np.sin(x * fx + c) * np.cos(y * fy)
        edges = 40 * (((x // rng.integers(40, 120)) + (y // rng.integers(40, 120))) % 2)
        texture = 20 * np.sin(x * rng.uniform(0.3, 1.2)) * np.sin(y * rng.uniform(0.3, 1.2))
        img[..., c] = smooth + edges + texture
    img += rng.normal(0, 6, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG with a gradient that depends on `seed`."""
    return png_encode(png_pixels(width, height, seed))


def png_encode(rgb: np.ndarray) -> bytes:
    """(height, width, 3) uint8 as an RGB PNG."""
    height, width = rgb.shape[:2]
    raw = b"".join(b"\x00" + row.tobytes() for row in rgb)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "STOKER_SOCKET", "STOKER_SHM_DIR")


def vm_rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc/<pid>/status."""
    for line in pathlib.Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


class Proc:
    """A child process whose first stdout line announces its addresses; killed on stop.

    ``popen``: extra subprocess.Popen arguments (user, group, extra_groups).
    """

    def __init__(self, args, env=None, popen=None):
        full_env = dict(os.environ)
        for k in TORCHRUN_ENV + ("AWS_PROFILE",):
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
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, env=full_env, **(popen or {}))
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

    def _start(self, args, env=None, popen=None):
        p = Proc(args, env, popen)
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

    def images(self, sizes, pixels=photo_pixels):
        """One PNG per (width, height) of `pixels(w, h, seed)`; returns (key, pixels) pairs."""
        out = []
        for i, (w, h) in enumerate(sizes):
            key = "big-%04d.png" % i
            rgb = pixels(w, h, i)
            self.put(key, png_encode(rgb))
            out.append((key, rgb))
        return out

    def s3_flags(self):
        return ["--endpoint", self.endpoint, "--region", "us-east-1", "--force-path-style", "--max-attempts", "3"]

    def decode_worker(self):
        p = self._start(
            [self.loader, "decode", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--threads", "1"]
            + self.s3_flags()
        )
        return p.field("grpc")

    def sidecar(self, *extra, workers=(), shm=None, loader=None, env=None, popen=None):
        """A sidecar; ``shm``: its shared-memory dir (made here when None); ``p.sockets``: one
        per local rank."""
        if shm is None:
            shm = self.tmp / ("shm-%d" % len(self.procs))
            shm.mkdir()
        args = [loader or self.loader, "sidecar", "--bucket", BUCKET, "--http-addr", "127.0.0.1:0"]
        args += ["--shm-dir", str(shm), "--local-decoders", "1"] + list(extra) + self.s3_flags()
        if workers:
            args += ["--workers", ",".join(workers)]
        p = self._start(args, env=env, popen=popen)
        p.sockets = p.field("socket").split(",")
        p.socket = p.sockets[0]
        p.shm = pathlib.Path(shm)
        return p

    def trainer(self, out, *args, rank=None, world_size=None, local_rank=None, shm=None, socket=None):
        """A trainer process (trainer_proc.py) with torchrun's environment; ``out``: the record
        it writes after every batch (its state_dict and the samples it trained on)."""
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        env["PYTHONPATH"] = str(CLIENT_SRC)
        for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", local_rank),
                            ("STOKER_SHM_DIR", shm), ("STOKER_SOCKET", socket)):
            if value is not None:
                env[name] = str(value)
        cmd = [sys.executable, str(TRAINER), "--out", str(out)] + [str(a) for a in args]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self):
        for p in reversed(self.procs):
            p.kill9()


def read_record(path):
    """A trainer's record: {"state": state_dict, "trained": {epoch: [keys]}, "batches": n}."""
    return json.loads(pathlib.Path(path).read_text())


def wait_all(procs, timeout):
    """Waits for every trainer; kills all and fails on the first that errs or outlives
    ``timeout`` (a deadlock must fail the test, not hang it)."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if p.returncode != 0:
                raise AssertionError("trainer %s exited %s:\n%s" % (p.args[-1], p.returncode, err[-3000:]))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        raise AssertionError("trainers still running after %.0fs: a deadlock" % timeout) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.stop()
