"""The tensors of a batch (torch, imported when first needed): what :meth:`stoker.Batch.torch`
and :mod:`stoker.torch` share. It imports neither the client nor the loader, so the client can
reach it lazily without an import cycle; a batch is used only through its attributes.
"""

from __future__ import annotations

from . import qwen
from .errors import StokerError


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


def _to_device(batch, array, device, non_blocking: bool):
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


def batch_tensors(batch, device=None, non_blocking: bool = True, **qwen_params):
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
