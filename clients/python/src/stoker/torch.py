"""PyTorch face of the client: :class:`Loader` and the tensors of a batch.

Thin on purpose: the iteration and checkpoint logic is :class:`stoker.Stream` (torch-free,
tested without torch) and the Qwen patching is :mod:`stoker.qwen` (shared with numpy); this
module only makes tensors. torch is imported when first needed, so ``import stoker`` (and
``import stoker.torch``) work without it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from . import qwen
from .client import Batch, StokerError
from .stream import Stream


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise StokerError("stoker.torch needs PyTorch: pip install torch") from e
    return torch


class TorchOps(qwen.ArrayOps):
    """:class:`stoker.qwen.ArrayOps` over torch tensors on ``device``."""

    def __init__(self, device):
        self.torch = _torch()
        self.device = device

    def permute(self, x, axes):
        return x.permute(*axes).contiguous()

    def to_float32(self, x):
        return x.to(self.torch.float32)

    def constant(self, values, shape):
        return self.torch.tensor(values, dtype=self.torch.float32, device=self.device).reshape(*shape)

    def expand(self, x, shape):
        return x.expand(*shape)

    def concat(self, xs):
        return self.torch.cat(xs, dim=0)

    def int64(self, rows):
        return self.torch.tensor(rows, dtype=self.torch.int64, device=self.device).reshape(-1, 3)

    def empty_float32(self, shape):
        return self.torch.empty(*shape, dtype=self.torch.float32, device=self.device)


def resolve_device(device=None):
    """``device``, else the current CUDA device when there is one, else the CPU."""
    torch = _torch()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def _to_device(batch: Batch, array, device, non_blocking: bool):
    """``array`` (a view of the ring) as a tensor on ``device``; on the CPU, still a view."""
    torch = _torch()
    src = torch.from_numpy(array)
    if device.type == "cpu":
        return src
    if device.type == "cuda":
        batch._client._pin_ring_for_cuda()
    out = src.to(device, non_blocking=non_blocking)
    if non_blocking and device.type == "cuda":
        # The slot must not be reused before the copy has read it: release() waits on this.
        batch._cuda_event = torch.cuda.Event()
        batch._cuda_event.record()
    return out


def batch_tensors(batch: Batch, device=None, non_blocking: bool = True, **qwen_params):
    """The pixels of ``batch`` as tensors on ``device``.

    crop/fit: uint8 (n, H, W, 3); on the CPU a view of the ring, valid until the batch is
    released. qwenSmart: ``{"pixel_values", "image_grid_thw"}`` (see
    :func:`stoker.qwen.qwen_inputs`; ``qwen_params`` as there): one uint8 copy of the packed
    samples to the device, then rescaled, normalized and patched there.
    """
    device = resolve_device(device)
    if batch.resize == "qwenSmart":
        pixels, shapes = batch.packed
        packed = _to_device(batch, pixels, device, non_blocking)
        return qwen.qwen_inputs(packed, shapes.tolist(), TorchOps(device), **qwen_params)
    return _to_device(batch, batch.array, device, non_blocking)


class Loader(Stream):
    """This rank's batches as torch tensors: use it where a DataLoader goes.

    ``for batch in loader`` runs one epoch and yields a dict:

    - crop/fit: ``{"images": uint8 (n, H, W, 3), "keys", "metadata", "skips"}``
    - qwenSmart: ``{"pixel_values", "image_grid_thw", "keys", "metadata", "skips"}``, the
      Qwen-VL vision input (``qwen``: :func:`stoker.qwen.qwen_inputs` parameters, e.g.
      ``stoker.QWEN3_VL``)

    ``keys``, ``metadata`` (manifest dicts) and ``skips`` ((key, reason) pairs) are lists.
    ``collate`` maps that dict to what the loop receives, e.g. to tokenize captions from
    ``metadata`` and return only the model's inputs (HF ``Trainer`` passes every key to the
    model). Tensors are on ``device`` (default: the current CUDA device, else the CPU) and stay
    valid after the next batch is requested, so frameworks that fetch ahead (Lightning, HF's
    gradient accumulation) are safe: on a GPU they are copies; on the CPU crop/fit images are
    cloned out of the ring.

    ``len``, ``set_epoch``, ``state_dict`` and ``load_state_dict`` are :class:`stoker.Stream`'s.
    """

    def __init__(
        self,
        socket_path: Optional[str] = None,
        *,
        device=None,
        non_blocking: bool = True,
        qwen: Optional[Dict[str, Any]] = None,
        collate: Optional[Callable[[Dict[str, Any]], Any]] = None,
        **stream_args,
    ):
        super().__init__(socket_path, collate=collate, **stream_args)
        self._device = device
        self.non_blocking = non_blocking
        self.qwen = dict(qwen or {})

    @property
    def device(self):
        return resolve_device(self._device)

    def _convert(self, batch: Batch) -> Dict[str, Any]:
        device = self.device
        tensors = batch_tensors(batch, device=device, non_blocking=self.non_blocking, **self.qwen)
        if isinstance(tensors, dict):
            out = dict(tensors)
        else:
            out = {"images": tensors.clone() if device.type == "cpu" else tensors}
        out.update(keys=list(batch.keys), metadata=batch.metadata, skips=list(batch.skips))
        return out
