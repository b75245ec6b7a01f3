"""PyTorch face of the client: :class:`Loader` and the tensors of a batch.

Thin on purpose: the iteration and checkpoint logic is :class:`stoker.Stream` (torch-free,
tested without torch) and the Qwen patching is :mod:`stoker.qwen` (shared with numpy); this
module only makes tensors. torch is imported when first needed, so ``import stoker`` (and
``import stoker.torch``) work without it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .client import Batch, StokerError
from .stream import Stream
from .tensors import TorchOps, _to_device, _torch, batch_tensors, resolve_device

__all__ = ["Loader", "TorchOps", "batch_tensors", "resolve_device", "_to_device", "_torch"]


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
