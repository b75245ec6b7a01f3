"""GPU check of the hand-off, run next to a sidecar on a machine with CUDA:

    python -m stoker.gpu_check --socket /dev/shm/stoker-0.sock --batches 64

1. registers the ring with ``cudaHostRegister`` and checks torch sees it as pinned memory;
2. measures the host-to-device copy (GB/s, from CUDA events around each copy) and the
   per-batch latency (``next`` sent until the batch is on the device);
3. checks the pixels on the GPU are bit-exact against the CPU path (``.array``/``.packed`` of
   the same batch, read while it is still held); for qwenSmart also that the
   ``pixel_values`` made on the device equal the numpy ones within 1e-5.

Prints a summary; exits 1 on a mismatch, 2 when there is no CUDA. ``scripts/gpu-check.sh``
starts the S3 server, a decoder and the sidecar and runs this. Importable without torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Optional

import numpy as np

from .client import Batch, Client

QWEN_TOLERANCE = 1e-5


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m stoker.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="the sidecar's socket (default: as stoker.Client)")
    ap.add_argument("--batches", type=int, default=64, help="batches to measure")
    ap.add_argument("--warmup", type=int, default=3, help="batches before measuring")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--expect-pinned", action="store_true", help="fail unless the sidecar says pinned_ring")
    return ap.parse_args(argv)


class Report:
    def __init__(self) -> None:
        self.copy_bytes = 0
        self.copy_s = 0.0
        self.latencies_ms: List[float] = []
        self.mismatches: List[str] = []
        self.batches = 0
        self.pinned = False


def check_pinned(client: Client, torch) -> bool:
    """Registers the ring once (what Batch.torch does) and asks CUDA whether it is page-locked."""
    client._pin_ring_for_cuda()
    return bool(torch.from_numpy(client._ring[:1]).is_pinned())


def check_batch(batch: Batch, device, torch, report: Report, t_request: float) -> None:
    """Copies one batch to the device, timing the copy, and compares it with the CPU path."""
    import stoker.torch as stoker_torch

    if batch.resize == "qwenSmart":
        host, shapes = batch.packed
    else:
        host, shapes = batch.array, None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    on_device = stoker_torch._to_device(batch, host, device, non_blocking=True)
    end.record()
    qwen_gpu = batch.torch(device=device) if shapes is not None else None
    torch.cuda.synchronize()
    report.latencies_ms.append((time.perf_counter() - t_request) * 1e3)
    expected = host.copy()  # the CPU path: the slot is ours until the batch is released
    report.copy_bytes += host.nbytes
    report.copy_s += start.elapsed_time(end) / 1e3
    if not torch.equal(on_device.cpu(), torch.from_numpy(expected)):
        report.mismatches.append("batch %d: GPU pixels differ from the CPU path" % batch.batch_id)
    if qwen_gpu is not None:
        qwen_cpu = batch.qwen_inputs()
        if not np.array_equal(qwen_gpu["image_grid_thw"].cpu().numpy(), qwen_cpu["image_grid_thw"]):
            report.mismatches.append("batch %d: image_grid_thw differs" % batch.batch_id)
        diff = np.abs(qwen_gpu["pixel_values"].cpu().numpy() - qwen_cpu["pixel_values"]).max()
        if diff > QWEN_TOLERANCE:
            report.mismatches.append("batch %d: pixel_values differ by %.2e on the GPU" % (batch.batch_id, diff))


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    client = Client(args.socket, connect_timeout=60, next_timeout=120)
    info = client.info
    report = Report()
    report.pinned = check_pinned(client, torch)
    seen = 0
    while report.batches < args.batches:
        t_request = time.perf_counter()
        item = client.next()
        if item is None:
            break
        if isinstance(item, tuple):
            continue
        with item as batch:
            seen += 1
            if seen <= args.warmup:
                continue
            check_batch(batch, device, torch, report, t_request)
            report.batches += 1
    client.close()

    lat = sorted(report.latencies_ms) or [float("nan")]
    gbps = report.copy_bytes / report.copy_s / 1e9 if report.copy_s else float("nan")
    print("stoker gpu check: %s" % torch.cuda.get_device_name(device))
    print("  sidecar placement   %s (gpu available: %s)" % (info["gpu"]["placement"], info["gpu"]["available"]))
    print("  ring registered     %s (cudaHostRegister; torch sees it pinned)" % report.pinned)
    print("  resize              %s" % info.get("resize", "?"))
    print("  batches measured    %d (%.1f MB each)" % (report.batches, report.copy_bytes / max(report.batches, 1) / 1e6))
    print("  H2D copy            %.1f GB/s" % gbps)
    print("  batch latency       p50 %.2f ms, p99 %.2f ms (next sent -> on the device)"
          % (statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))]))
    print("  pixels bit-exact    %s" % ("yes" if not report.mismatches else "NO"))
    for m in report.mismatches[:10]:
        print("    " + m)
    failed = bool(report.mismatches) or not report.pinned or report.batches == 0
    if args.expect_pinned and info["gpu"]["placement"] != "pinned_ring":
        print("  the sidecar did not choose pinned_ring: %s" % info["gpu"].get("reason"))
        failed = True
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
