"""Trainer-side client of the stoker sidecar.

``for batch in stoker.Stream(): ...`` yields this rank's :class:`Batch` objects, whose arrays
are views into the sidecar's shared-memory ring, one epoch per iteration, with the
``state_dict``/``load_state_dict`` of a stateful DataLoader. ``stoker.torch.Loader`` is the same
yielding torch tensors (torch is imported only there).
"""

from .client import (
    Batch,
    Client,
    DataTimeout,
    PackedImages,
    PermissionDenied,
    SidecarUnavailable,
    SourceUnavailable,
    StokerError,
    batches,
    default_socket_path,
)
from .qwen import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, QWEN2_VL, QWEN3_VL, qwen_inputs
from .stream import StateMismatch, Stream

__all__ = [
    "Batch",
    "Client",
    "DataTimeout",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "PackedImages",
    "PermissionDenied",
    "QWEN2_VL",
    "QWEN3_VL",
    "SidecarUnavailable",
    "SourceUnavailable",
    "StateMismatch",
    "StokerError",
    "Stream",
    "batches",
    "default_socket_path",
    "qwen_inputs",
]
__version__ = "0.2.0"
