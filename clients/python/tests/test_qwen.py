"""qwenSmart end to end: the sidecar's resize plus the client's patching against the real
transformers Qwen2-VL image processor.

transformers 5 moved ``Qwen2VLImageProcessor`` onto torchvision (it imports torch); its
torch-free twin ``Qwen2VLImageProcessorPil`` (same smart_resize, same patchify, PIL resize) is
the reference here. With transformers 4, ``Qwen2VLImageProcessor`` is that numpy processor.
"""

import numpy as np
import pytest

import stoker
from stoker.qwen import QwenShapeError

# The sidecar's default --min-pixels/--max-pixels (Qwen2.5-VL's preprocessor_config), passed
# explicitly so that the processor is configured from the same numbers.
MIN_PIXELS = 3136
MAX_PIXELS = 12845056
# Four images above one megapixel, both orientations.
SIZES = [(1600, 1200), (2000, 1500), (1200, 1600), (1500, 2000)]


def processor(**params):
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Processor
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Processor
    return Processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, **params)


def reference(proc, images, **kwargs):
    out = proc(images=list(images), return_tensors="np", input_data_format="channels_last", **kwargs)
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


@pytest.mark.parametrize("preset", ["QWEN2_VL", "QWEN3_VL"])
def test_patches_match_the_processor_within_1e_5(preset):
    params = getattr(stoker, preset)
    factor = params["patch_size"] * params["merge_size"]
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (factor * a, factor * b, 3), dtype=np.uint8) for a, b in [(2, 3), (4, 1), (1, 1)]]
    packed = np.concatenate([im.reshape(-1) for im in images])
    shapes = np.array([im.shape[:2] for im in images])
    ours = stoker.qwen_inputs(packed, shapes, **params)
    proc_params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()}
    ref_values, ref_grid = reference(processor(**proc_params), images, do_resize=False)
    assert ours["pixel_values"].dtype == np.float32 and ours["image_grid_thw"].dtype == np.int64
    assert ours["pixel_values"].shape == ref_values.shape
    np.testing.assert_array_equal(ours["image_grid_thw"], ref_grid)
    assert np.abs(ours["pixel_values"] - ref_values).max() < 1e-5


def test_sizes_that_do_not_fit_the_patch_grid_are_a_clear_error():
    image = np.zeros((28, 42, 3), dtype=np.uint8)
    with pytest.raises(QwenShapeError, match="--factor"):
        stoker.qwen_inputs(image.reshape(-1), [(28, 42)])
    with pytest.raises(QwenShapeError, match="multiple of patch_size x merge_size = 32"):
        stoker.qwen_inputs(np.zeros(56 * 56 * 3, dtype=np.uint8), [(56, 56)], **stoker.QWEN3_VL)


def test_qwen_smart_batch_through_a_decode_worker_matches_the_processor(env):
    originals = env.images(SIZES)
    worker = env.decode_worker()
    # Four samples of up to 1988x1512 at 3 bytes: 36 MB; the default slot holds 1 MP a sample.
    slot_bytes = sum(w * h * 3 for w, h in SIZES) + (1 << 20)
    sc = env.sidecar(
        "--resize", "qwenSmart", "--max-pixels", str(MAX_PIXELS), "--min-pixels", str(MIN_PIXELS),
        "--batch-size", "4", "--no-shuffle", "--epochs", "1", "--slot-bytes", str(slot_bytes),
        "--prefetch-batches", "1", "--held-batches", "1",
        workers=[worker],
    )
    client = stoker.Client(sc.socket, connect_timeout=10, next_timeout=120)
    batch = client.next()
    assert isinstance(batch, stoker.Batch)
    assert batch.route == "remote", "decoded by the worker"
    assert batch.skips == [], "no sample skipped"
    assert batch.keys == [k for k, _ in originals]

    pixels, shapes = batch.packed
    assert not pixels.flags.owndata, "the packed view is the ring, not a copy"
    assert pixels.nbytes == int((shapes[:, 0] * shapes[:, 1] * 3).sum())
    ours = batch.qwen_inputs()

    proc = processor()
    # Shapes: the processor's smart_resize on the original images.
    _, grid_on_originals = reference(proc, [px for _, px in originals])
    np.testing.assert_array_equal(ours["image_grid_thw"], grid_on_originals)
    assert [tuple(s) for s in shapes] == [tuple(g[1:] * 14) for g in grid_on_originals]

    # Pixels: the processor's rescale, normalize and patchify on our resized images.
    resized = [im.copy() for im in batch.images]
    ref_values, _ = reference(proc, resized, do_resize=False)
    assert ours["pixel_values"].shape == ref_values.shape
    assert np.abs(ours["pixel_values"] - ref_values).max() < 1e-5

    # Against the processor's own resize (PIL bicubic; the sidecar's is a bilinear convolution):
    # close, not equal. Measured on these photo-like images: mean 0.0175 (about 1.2 gray levels
    # at the CLIP std), p99 0.06. Bound: 0.05, about 3.4 gray levels.
    own_values, _ = reference(proc, [px for _, px in originals])
    diff = np.abs(ours["pixel_values"] - own_values)
    print("qwenSmart vs the processor's own resize: mean abs diff %.4f, p99 %.4f (normalized units)"
          % (diff.mean(), np.percentile(diff, 99)))
    assert diff.mean() < 0.05

    batch.release()
    assert client.next() == ("end_of_epoch", 0)
    client.close()
