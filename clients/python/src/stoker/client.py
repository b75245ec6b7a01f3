"""The unix-socket protocol of ``stoker-loader sidecar`` and the shared-memory ring.

One JSON object per line each way. ``hello`` says the trainer's rank (torchrun's ``RANK`` and
``WORLD_SIZE``) and returns the ring file, its geometry and where this rank's stream stands;
``next`` returns the next batch of the planned order (slot, shapes, keys, metadata, skips, the
epoch position after it) or the end of an epoch; ``release`` gives a slot back; ``seek``
restarts the stream at a checkpointed (epoch, position). Pixels never cross the socket: they are
read in place from the ring, which this module maps once.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import time
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

from . import qwen
from .errors import StokerError


class SidecarUnavailable(StokerError):
    """The sidecar cannot be reached or stopped answering."""


class DataTimeout(StokerError):
    """The sidecar is alive but had no batch ready within the timeout."""


class SourceUnavailable(StokerError):
    """The data source refuses the samples (access denied, expired credentials, a bucket gone)
    or kept failing past the sidecar's retry budget. Delivery stopped rather than hand over
    batches with samples missing; the message names the object and the cause. Once the source
    is fixed, ``Stream.load_state_dict`` (a seek) resumes where the trainer stands."""


class PermissionDenied(StokerError, PermissionError):
    """The sidecar's socket or ring exists but this process may not use it (no shared group)."""


#: How long a socket that refuses us is retried before PermissionDenied: the sidecar binds it,
#: then opens its mode to the group, and a trainer connecting in between must not fail.
_PERMISSION_GRACE_S = 3.0


class PackedImages(NamedTuple):
    """The decoded samples of a batch back to back.

    ``pixels``: one contiguous 1-D uint8 buffer holding each (h, w, 3) image in turn;
    ``shapes``: (n, 2) int64, the (h, w) of each.
    """

    pixels: np.ndarray
    shapes: np.ndarray


def default_socket_path() -> str:
    """``STOKER_SOCKET``, else ``$STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock``: the sidecar's
    default, one socket per local rank, which is what torchrun pods use."""
    path = os.environ.get("STOKER_SOCKET")
    if path:
        return path
    shm = os.environ.get("STOKER_SHM_DIR", "/dev/shm")
    return os.path.join(shm, "stoker-%s.sock" % os.environ.get("LOCAL_RANK", "0"))


def rank_from_env() -> Tuple[Optional[int], Optional[int]]:
    """(RANK, WORLD_SIZE) as torchrun sets them, or (None, None) when either is missing."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None, None
    try:
        return int(rank), int(world)
    except ValueError:
        raise StokerError("RANK=%r and WORLD_SIZE=%r must be integers" % (rank, world)) from None


def _describe_owner(path: str) -> str:
    """Owner, group and mode of ``path``, else of the nearest directory above it we can stat."""
    while True:
        try:
            st = os.stat(path)
            return "%s is %d:%d mode %o" % (path, st.st_uid, st.st_gid, st.st_mode & 0o7777)
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return "nothing above it can be read"
            path = parent


def _permission_message(path: str, what: str, err: OSError) -> str:
    groups = sorted(set(os.getgroups()) | {os.getgid()})
    return (
        "permission denied on the stoker %s %s (%s; %s) for this process, uid %d with groups %s. "
        "The trainer and the sidecar must share a group with read-write access to the "
        "shared-memory directory: in Kubernetes, set the pod's securityContext.fsGroup."
        % (what, path, err.strerror or err, _describe_owner(path), os.getuid(), groups)
    )


class Batch:
    """One decoded batch, held in a ring slot until :meth:`release`.

    ``images`` are (H, W, 3) uint8 views into shared memory, one per decoded sample;
    ``array`` stacks them without a copy when they share a shape (crop, fit); ``packed`` gives
    the ragged samples of qwenSmart as one buffer plus shapes. Skipped samples (corrupt,
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
        #: The epoch position once every rank has consumed this batch: what a checkpoint taken
        #: after training on it resumes from (None from a sidecar older than this client).
        self.position: Optional[int] = header.get("position")
        self.route: str = header["route"]
        #: The sidecar's resize mode: crop, fit or qwenSmart.
        self.resize: str = client.info.get("resize", "crop")
        samples = header["samples"]
        base = header["slot_offset"]
        buf = client._ring
        self.keys: List[str] = []
        self.images: List[np.ndarray] = []
        self.skips: List[Tuple[str, str]] = []
        self._metadata_text: List[str] = []
        self._spans: List[Tuple[int, int]] = []
        for s in samples:
            if s["skip"]:
                self.skips.append((s["key"], s["skip"]))
                continue
            h, w, c = s["shape"]
            start = base + s["offset"]
            self.keys.append(s["key"])
            self._metadata_text.append(s["metadata"])
            self.images.append(buf[start : start + h * w * c].reshape(h, w, c))
            self._spans.append((start, start + h * w * c))
        self._contiguous = all(a[1] == b[0] for a, b in zip(self._spans, self._spans[1:]))
        self._array: Optional[np.ndarray] = None
        shapes = {im.shape for im in self.images}
        if len(shapes) == 1 and self._contiguous:
            # Decoded samples are packed back to back, so equal shapes form one block.
            h, w, c = self.images[0].shape
            start = self._spans[0][0]
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
            raise StokerError("samples of this batch have different shapes (qwenSmart); use .packed or .images")
        return self._array

    @property
    def packed(self) -> PackedImages:
        """The decoded samples as one contiguous uint8 buffer plus their (h, w) shapes.

        A view of the ring when the slot holds them back to back (the sidecar packs them so),
        else a copy. Valid, like ``images``, until the batch is released.
        """
        self._check_live()
        shapes = np.array([im.shape[:2] for im in self.images], dtype=np.int64).reshape(-1, 2)
        if not self.images:
            return PackedImages(np.empty(0, dtype=np.uint8), shapes)
        if self._contiguous:
            pixels = self._client._ring[self._spans[0][0] : self._spans[-1][1]]
        else:
            pixels = np.concatenate([im.reshape(-1) for im in self.images])
        return PackedImages(pixels, shapes)

    def qwen_inputs(self, **params) -> Dict[str, np.ndarray]:
        """The Qwen2/2.5/3-VL vision input of this (qwenSmart) batch, as numpy arrays.

        ``pixel_values`` float32 (sum of t*h*w patches, 3*temporal*patch*patch) and
        ``image_grid_thw`` int64 (n, 3), in the layout of transformers'
        ``Qwen2VLImageProcessor``. ``params``: see :func:`stoker.qwen.qwen_inputs`
        (``**stoker.QWEN3_VL`` for Qwen3-VL).
        """
        pixels, shapes = self.packed
        return qwen.qwen_inputs(pixels, shapes, qwen.NUMPY, **params)

    @property
    def metadata(self) -> List[Dict[str, Any]]:
        """Manifest metadata of each decoded sample (caption, label, ...); {} when listed."""
        return [json.loads(t) if t else {} for t in self._metadata_text]

    def torch(self, device: Optional[Any] = None, non_blocking: bool = True, **qwen_params):
        """The batch as torch tensors: see :func:`stoker.tensors.batch_tensors`.

        crop/fit: a uint8 (n, H, W, 3) tensor. qwenSmart: ``{"pixel_values",
        "image_grid_thw"}``, normalized on the device after one uint8 copy. With CUDA present
        (or ``device`` given) the copy reads the pinned ring with ``non_blocking``; on CPU the
        crop/fit tensor is a view of the ring, valid until the batch is released.
        """
        from . import tensors

        return tensors.batch_tensors(self, device=device, non_blocking=non_blocking, **qwen_params)

    def _check_live(self) -> None:
        if self._released:
            raise StokerError("batch %d was released; its arrays are no longer valid" % self.batch_id)

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

    ``rank``/``world_size``: this trainer's place in the job, sent in ``hello`` so the sidecar
    serves this socket's stream for it (an elastic restart with a new world size); default:
    torchrun's ``RANK`` and ``WORLD_SIZE`` when both are set, else the sidecar's own.
    ``connect_timeout``: how long to wait for the sidecar to start listening (it may start
    after the trainer). ``next_timeout``: how long one ``next`` may wait for a batch before
    :class:`DataTimeout`; the socket itself times out a few seconds later, so a dead sidecar
    raises :class:`SidecarUnavailable` instead of hanging.
    """

    def __init__(
        self,
        socket_path: Optional[str] = None,
        connect_timeout: float = 30.0,
        next_timeout: float = 120.0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        self.socket_path = socket_path or default_socket_path()
        self.next_timeout = next_timeout
        if rank is None and world_size is None:
            rank, world_size = rank_from_env()
        elif rank is None or world_size is None:
            raise StokerError("give both rank and world_size, or neither")
        self._sock = self._connect(connect_timeout)
        self._rfile = self._sock.makefile("rb")
        self._pinned = False
        self._closed = False
        self._held: Dict[int, Batch] = {}
        #: Seconds this client spent blocked in ``next`` (the trainer's data wait).
        self.data_wait_s = 0.0
        hello_msg: Dict[str, Any] = {"op": "hello"}
        if rank is not None:
            hello_msg.update(rank=rank, world_size=world_size)
        hello = self._call(hello_msg, timeout=max(connect_timeout, 5.0))
        if hello.get("type") != "hello":
            raise StokerError("the sidecar at %s refused hello: %s" % (self.socket_path, hello.get("message", hello)))
        if rank is not None and (hello.get("rank"), hello.get("world_size")) != (rank, world_size):
            raise StokerError(
                "asked the sidecar at %s for rank %d of %d, it serves rank %s of %s: is the sidecar "
                "older than this client?" % (self.socket_path, rank, world_size, hello.get("rank"), hello.get("world_size"))
            )
        #: The ``hello`` reply: ring geometry, rank, world_size, batch_size, batches_per_epoch,
        #: samples, seed, resize, epoch and position (where the stream stands), gpu.
        self.info: Dict[str, Any] = hello
        try:
            fd = os.open(hello["shm_path"], os.O_RDWR)
        except PermissionError as e:
            raise PermissionDenied(_permission_message(hello["shm_path"], "ring", e)) from e
        try:
            size = hello["slots"] * hello["slot_bytes"]
            # Shared and writable so that torch.from_numpy accepts the views; never written here.
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._ring = np.frombuffer(self._mmap, dtype=np.uint8)

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        denied_since: Optional[float] = None
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
                if e.errno in (errno.EACCES, errno.EPERM):
                    now = time.monotonic()
                    denied_since = now if denied_since is None else denied_since
                    if now - denied_since >= min(_PERMISSION_GRACE_S, timeout):
                        raise PermissionDenied(_permission_message(self.socket_path, "socket", e)) from e
                else:
                    denied_since = None
            if time.monotonic() >= deadline:
                raise SidecarUnavailable(
                    "no stoker sidecar at %s after %.0fs (%s): is the pod labelled "
                    "stoker.dev/pipeline, and are STOKER_SHM_DIR and LOCAL_RANK (or STOKER_SOCKET) "
                    "right?" % (self.socket_path, timeout, last)
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
        self._held.pop(slot, None)
        if not self._closed:  # a closed connection's slots went back when it closed
            self._send({"op": "release", "slot": slot})

    def release_all(self) -> None:
        """Releases every batch this connection holds (their arrays become invalid)."""
        for batch in list(self._held.values()):
            batch.release()

    def next(self, timeout: Optional[float] = None):
        """The next item: a :class:`Batch`, ``("end_of_epoch", epoch)`` or ``None`` when done."""
        timeout = self.next_timeout if timeout is None else timeout
        t0 = time.monotonic_ns()
        reply = self._call({"op": "next", "timeout_ms": int(timeout * 1000)}, timeout=timeout + 10.0)
        kind = reply.get("type")
        if kind == "batch":
            batch = Batch(self, reply, t0)
            self._held[batch.slot] = batch
            self.data_wait_s += (time.monotonic_ns() - t0) / 1e9
            return batch
        self.data_wait_s += (time.monotonic_ns() - t0) / 1e9
        if kind == "end_of_epoch":
            return ("end_of_epoch", reply["epoch"])
        if kind == "done":
            return None
        if kind == "timeout":
            raise DataTimeout("no batch ready within %.0fs (the sidecar is up; check its decode workers)" % timeout)
        if kind == "source_unavailable":
            raise SourceUnavailable(reply["message"])
        raise StokerError("sidecar error: %s" % reply.get("message", reply))

    def seek(self, epoch: int, position: int, seed: int, batch_size: int, samples: int) -> Dict[str, Any]:
        """Restarts this rank's stream at ``position`` of ``epoch``; returns the ``seeked`` reply
        (``batches``: what is left of the epoch for this rank).

        ``seed``, ``batch_size`` and ``samples`` are the checkpoint's: the sidecar refuses a
        seek into a different order. Batches still held are released first.
        """
        self.release_all()
        msg = {"op": "seek", "epoch": epoch, "position": position, "seed": seed, "batch_size": batch_size, "samples": samples}
        reply = self._call(msg, timeout=max(self.next_timeout, 30.0))
        if reply.get("type") != "seeked":
            raise StokerError("the sidecar refused to seek to epoch %d position %d: %s" % (epoch, position, reply.get("message", reply)))
        return reply

    def close(self) -> None:
        """Closes the connection; the sidecar takes back any slot still held."""
        self._closed = True
        self._held.clear()
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
    for one iteration; ``.copy()`` what must live longer. For checkpoint/resume use
    :class:`stoker.Stream`, which keeps the state.
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
