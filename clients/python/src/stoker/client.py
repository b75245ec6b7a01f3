"""The unix-socket protocol of ``stoker-loader sidecar`` and the shared-memory ring.

One JSON object per line each way. ``hello`` returns the ring file and its geometry; ``next``
returns the next batch of the planned order (slot, shapes, keys, metadata, skips) or the end of
an epoch; ``release`` gives a slot back. Pixels never cross the socket: they are read in place
from the ring, which this module maps once.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np


class StokerError(RuntimeError):
    """Base class of the client's errors."""


class SidecarUnavailable(StokerError):
    """The sidecar cannot be reached or stopped answering."""


class DataTimeout(StokerError):
    """The sidecar is alive but had no batch ready within the timeout."""


def default_socket_path() -> str:
    """``STOKER_SOCKET``, else ``$STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock`` (the sidecar's default)."""
    path = os.environ.get("STOKER_SOCKET")
    if path:
        return path
    shm = os.environ.get("STOKER_SHM_DIR", "/dev/shm")
    return os.path.join(shm, "stoker-%s.sock" % os.environ.get("LOCAL_RANK", "0"))


class Batch:
    """One decoded batch, held in a ring slot until :meth:`release`.

    ``images`` are (H, W, 3) uint8 views into shared memory, one per decoded sample;
    ``array`` stacks them without a copy when they share a shape. Skipped samples (corrupt,
    missing, ...) are listed in ``skips`` and have no image.
    """

    def __init__(self, client: "Client", header: Dict[str, Any], request_ns: int):
        self._client = client
        self._header = header
        self._released = False
        self._cuda_event = None
        self.slot: int = header["slot"]
        self.epoch: int = header["epoch"]
        self.index: int = header["index"]
        self.batch_id: int = header["batch_id"]
        self.route: str = header["route"]
        samples = header["samples"]
        base = header["slot_offset"]
        buf = client._ring
        self.keys: List[str] = []
        self.images: List[np.ndarray] = []
        self.skips: List[Tuple[str, str]] = []
        self._metadata_text: List[str] = []
        for s in samples:
            if s["skip"]:
                self.skips.append((s["key"], s["skip"]))
                continue
            h, w, c = s["shape"]
            start = base + s["offset"]
            self.keys.append(s["key"])
            self._metadata_text.append(s["metadata"])
            self.images.append(buf[start : start + h * w * c].reshape(h, w, c))
        self._array: Optional[np.ndarray] = None
        shapes = {im.shape for im in self.images}
        if len(shapes) == 1 and self.images:
            # Decoded samples are packed back to back, so equal shapes form one block.
            h, w, c = self.images[0].shape
            start = base + samples[[i for i, s in enumerate(samples) if not s["skip"]][0]]["offset"]
            self._array = buf[start : start + len(self.images) * h * w * c].reshape(len(self.images), h, w, c)
        now = time.monotonic_ns()
        #: Nanoseconds from the later of (slot ready, request sent) to this object holding the
        #: arrays: the hand-off latency.
        self.handoff_ns: int = now - max(header["ready_ns"], request_ns)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def array(self) -> np.ndarray:
        """(n, H, W, 3) uint8 view of the decoded samples; needs equal shapes (crop, fit)."""
        if self._array is None:
            if not self.images:
                return np.empty((0, 0, 0, 3), dtype=np.uint8)
            raise StokerError("samples of this batch have different shapes (qwenSmart); use .images")
        return self._array

    @property
    def metadata(self) -> List[Dict[str, Any]]:
        """Manifest metadata of each decoded sample (caption, label, ...); {} when listed."""
        return [json.loads(t) if t else {} for t in self._metadata_text]

    def torch(self, device: Optional[Any] = None, non_blocking: bool = True):
        """The batch as a uint8 (n, H, W, 3) tensor.

        With CUDA present (or ``device`` given) it is copied to the GPU from pinned memory
        with ``non_blocking``: the ring is registered once with ``cudaHostRegister``. On CPU it
        is a view of the ring, valid until the batch is released.
        """
        import torch

        src = torch.from_numpy(self.array)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cpu":
            return src
        self._client._pin_ring_for_cuda()
        out = src.to(device, non_blocking=non_blocking)
        if non_blocking:
            # The slot must not be reused before the copy has read it.
            self._cuda_event = torch.cuda.Event()
            self._cuda_event.record()
        return out

    def release(self) -> None:
        """Gives the slot back; the arrays must not be used afterwards."""
        if self._released:
            return
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        self._released = True
        self.images = []
        self._array = None
        self._client._release(self.slot)

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Client:
    """A connection to the sidecar.

    ``connect_timeout``: how long to wait for the sidecar to start listening (it may start
    after the trainer). ``next_timeout``: how long one ``next`` may wait for a batch before
    :class:`DataTimeout`; the socket itself times out a few seconds later, so a dead sidecar
    raises :class:`SidecarUnavailable` instead of hanging.
    """

    def __init__(self, socket_path: Optional[str] = None, connect_timeout: float = 30.0, next_timeout: float = 120.0):
        self.socket_path = socket_path or default_socket_path()
        self.next_timeout = next_timeout
        self._sock = self._connect(connect_timeout)
        self._rfile = self._sock.makefile("rb")
        self._pinned = False
        #: Seconds this client spent blocked in ``next`` (the trainer's data wait).
        self.data_wait_s = 0.0
        hello = self._call({"op": "hello"}, timeout=max(connect_timeout, 5.0))
        if hello.get("type") != "hello":
            raise StokerError("unexpected answer to hello: %r" % (hello,))
        self.info: Dict[str, Any] = hello
        fd = os.open(hello["shm_path"], os.O_RDWR)
        try:
            size = hello["slots"] * hello["slot_bytes"]
            # Shared and writable so that torch.from_numpy accepts the views; never written here.
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._ring = np.frombuffer(self._mmap, dtype=np.uint8)

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        last: Optional[BaseException] = None
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.connect(self.socket_path)
                return s
            except OSError as e:
                s.close()
                last = e
            if time.monotonic() >= deadline:
                raise SidecarUnavailable(
                    "no stoker sidecar at %s after %.0fs (%s): is the pod labelled "
                    "stoker.dev/pipeline, and is STOKER_SOCKET right?" % (self.socket_path, timeout, last)
                )
            time.sleep(0.1)

    def _send(self, msg: Dict[str, Any]) -> None:
        try:
            self._sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError as e:
            raise SidecarUnavailable("the stoker sidecar at %s went away: %s" % (self.socket_path, e)) from e

    def _call(self, msg: Dict[str, Any], timeout: float) -> Dict[str, Any]:
        self._sock.settimeout(timeout)
        self._send(msg)
        try:
            line = self._rfile.readline()
        except (socket.timeout, OSError) as e:
            raise SidecarUnavailable(
                "the stoker sidecar at %s did not answer within %.0fs: %s" % (self.socket_path, timeout, e)
            ) from e
        if not line:
            raise SidecarUnavailable("the stoker sidecar at %s closed the connection" % self.socket_path)
        return json.loads(line)

    def _pin_ring_for_cuda(self) -> None:
        if self._pinned:
            return
        import torch

        ptr = self._ring.ctypes.data
        # Registering once costs far less than pinning per batch; flag 0 = portable default.
        err = torch.cuda.cudart().cudaHostRegister(ptr, self._ring.nbytes, 0)
        if int(err) != 0:
            raise StokerError("cudaHostRegister of the ring failed: %s" % (err,))
        self._pinned = True

    def _release(self, slot: int) -> None:
        self._send({"op": "release", "slot": slot})

    def next(self, timeout: Optional[float] = None):
        """The next item: a :class:`Batch`, ``("end_of_epoch", epoch)`` or ``None`` when done."""
        timeout = self.next_timeout if timeout is None else timeout
        t0 = time.monotonic_ns()
        reply = self._call({"op": "next", "timeout_ms": int(timeout * 1000)}, timeout=timeout + 10.0)
        kind = reply.get("type")
        if kind == "batch":
            batch = Batch(self, reply, t0)
            self.data_wait_s += (time.monotonic_ns() - t0) / 1e9
            return batch
        self.data_wait_s += (time.monotonic_ns() - t0) / 1e9
        if kind == "end_of_epoch":
            return ("end_of_epoch", reply["epoch"])
        if kind == "done":
            return None
        if kind == "timeout":
            raise DataTimeout("no batch ready within %.0fs (the sidecar is up; check its decode workers)" % timeout)
        raise StokerError("sidecar error: %s" % reply.get("message", reply))

    def close(self) -> None:
        """Closes the connection; the sidecar takes back any slot still held."""
        try:
            self._sock.close()
        finally:
            self._ring = None  # type: ignore[assignment]
            try:
                self._mmap.close()
            except (BufferError, ValueError):
                # Arrays still alive keep the mapping; it goes away with them.
                pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_client: Optional[Client] = None


def batches(client: Optional[Client] = None, epochs: Optional[int] = 1) -> Iterator[Batch]:
    """Yields the batches of ``epochs`` epochs (None: until the sidecar is done).

    The previous batch is released when the next one is requested, so its arrays are valid
    for one iteration; ``.copy()`` what must live longer.
    """
    global _default_client
    if client is None:
        if _default_client is None:
            _default_client = Client()
        client = _default_client
    finished = 0
    previous: Optional[Batch] = None
    try:
        while epochs is None or finished < epochs:
            if previous is not None:
                previous.release()
                previous = None
            item = client.next()
            if item is None:
                return
            if isinstance(item, tuple):
                finished += 1
                continue
            previous = item
            yield item
    finally:
        if previous is not None:
            try:
                previous.release()
            except StokerError:
                pass
