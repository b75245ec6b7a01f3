"""The Qwen-VL vision input from qwenSmart batches, written once over an array namespace.

The sidecar's ``qwenSmart`` resize already gives each sample the size Qwen's ``smart_resize``
picks (sides multiples of patch_size x merge_size). What is left is the image processor's
tail: rescale by 1/255, normalize per channel, repeat the single frame to
``temporal_patch_size`` and cut the image into patches in the order the vision tower reads
them. :func:`qwen_inputs` does that with numpy (tests, CPU) or torch on the GPU
(:mod:`stoker.torch`: the uint8 pixels cross PCIe, the float32 patches are made on the
device), through the few operations of :class:`ArrayOps`.

Layout, as transformers' ``Qwen2VLImageProcessor``: per image, the frames are reshaped to
``(t, tp, c, gh/m, m, p, gw/m, m, p)``, transposed by ``(0, 3, 6, 4, 7, 2, 1, 5, 8)`` and
flattened to ``(t*gh*gw, c*tp*p*p)``, with t = 1 for an image. Here the uint8 image is permuted
first and the frame repeat is a broadcast, which gives the same rows with one float pass.

Presets: :data:`QWEN2_VL` (Qwen2-VL and Qwen2.5-VL: patch 14, CLIP mean/std; sidecar
``--factor 28``) and :data:`QWEN3_VL` (patch 16, mean/std 0.5; sidecar ``--factor 32``).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

#: transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (Qwen2-VL, Qwen2.5-VL).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

QWEN2_VL: Dict[str, Any] = dict(
    patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD
)
QWEN3_VL: Dict[str, Any] = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)
)


class QwenShapeError(ValueError):
    """A sample's size is not a multiple of patch_size x merge_size."""


class ArrayOps:
    """The operations :func:`qwen_inputs` needs beyond indexing, reshape and arithmetic."""

    def permute(self, x, axes: Sequence[int]):
        raise NotImplementedError

    def to_float32(self, x):
        raise NotImplementedError

    def constant(self, values, shape: Sequence[int]):
        """float32 constant of ``shape`` where ``x`` lives."""
        raise NotImplementedError

    def expand(self, x, shape: Sequence[int]):
        """Broadcast view of ``x`` to ``shape``."""
        raise NotImplementedError

    def concat(self, xs):
        raise NotImplementedError

    def int64(self, rows):
        raise NotImplementedError

    def empty_float32(self, shape: Sequence[int]):
        raise NotImplementedError


class NumpyOps(ArrayOps):
    def permute(self, x, axes):
        return np.ascontiguousarray(x.transpose(axes))

    def to_float32(self, x):
        return x.astype(np.float32)

    def constant(self, values, shape):
        return np.asarray(values, dtype=np.float32).reshape(shape)

    def expand(self, x, shape):
        return np.broadcast_to(x, shape)

    def concat(self, xs):
        return np.concatenate(xs, axis=0)

    def int64(self, rows):
        return np.asarray(rows, dtype=np.int64).reshape(-1, 3)

    def empty_float32(self, shape):
        return np.empty(shape, dtype=np.float32)


NUMPY = NumpyOps()


def qwen_inputs(
    pixels,
    shapes,
    ops: ArrayOps = NUMPY,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    image_mean: Sequence[float] = OPENAI_CLIP_MEAN,
    image_std: Sequence[float] = OPENAI_CLIP_STD,
) -> Dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` for packed uint8 images.

    ``pixels``: 1-D uint8 array (numpy or torch) holding the (h, w, 3) images back to back;
    ``shapes``: their (h, w). Returns ``pixel_values`` float32 of shape
    (sum of grid_t*grid_h*grid_w, 3*temporal_patch_size*patch_size**2) and ``image_grid_thw``
    int64 (n, 3), both of ``ops``' kind.
    """
    p, m, tp = patch_size, merge_size, temporal_patch_size
    c = 3
    factor = p * m
    mean = ops.constant(image_mean, (c, 1, 1))
    std = ops.constant(image_std, (c, 1, 1))
    patches = []
    grids = []
    offset = 0
    for h, w in [(int(h), int(w)) for h, w in shapes]:
        if h % factor or w % factor:
            raise QwenShapeError(
                "a %dx%d sample is not a multiple of patch_size x merge_size = %d: the sidecar's "
                "--factor must equal it (Qwen2/2.5-VL 28, Qwen3-VL 32)" % (w, h, factor)
            )
        gh, gw = h // p, w // p
        image = pixels[offset : offset + h * w * c]
        offset += h * w * c
        # (h, w, c) = (gh/m, m, p, gw/m, m, p, c) -> (gh/m, gw/m, m, m, c, p, p): permuted while
        # still uint8 (a quarter of the bytes), normalized once in the final order.
        x = ops.permute(image.reshape(gh // m, m, p, gw // m, m, p, c), (0, 3, 1, 4, 6, 2, 5))
        x = (ops.to_float32(x) * (1.0 / 255.0) - mean) / std
        # The image is one frame: repeat it temporal_patch_size times, right after the channel.
        x = ops.expand(x.reshape(gh // m, gw // m, m, m, c, 1, p, p), (gh // m, gw // m, m, m, c, tp, p, p))
        patches.append(x.reshape(gh * gw, c * tp * p * p))
        grids.append((1, gh, gw))
    if not patches:
        return {"pixel_values": ops.empty_float32((0, c * tp * p * p)), "image_grid_thw": ops.int64([])}
    return {"pixel_values": ops.concat(patches), "image_grid_thw": ops.int64(grids)}
