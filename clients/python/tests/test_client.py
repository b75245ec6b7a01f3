"""The client against a real sidecar, decode worker and S3 server."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import stoker

HERE = os.path.dirname(os.path.abspath(__file__))


def test_toy_training_loop_with_numpy_sees_every_sample_once(env):
    keys = env.dataset(24)
    worker = env.decode_worker()
    sc = env.sidecar("--batch-size", "4", "--width", "32", "--height", "24", "--epochs", "2", workers=[worker])
    client = stoker.Client(sc.socket, connect_timeout=10)
    assert client.info["batches_per_epoch"] == 6
    # A toy linear model on the mean colour: a training step per batch.
    weights = np.zeros(3)
    for epoch in range(2):
        seen = []
        for batch in stoker.batches(client):
            x = batch.array
            assert x.shape == (4, 24, 32, 3) and x.dtype == np.uint8
            assert not x.flags.owndata, "a view into the ring, not a copy"
            assert batch.epoch == epoch
            assert batch.handoff_ns >= 0
            features = x.reshape(len(x), -1, 3).mean(axis=1) / 255.0
            weights -= 0.1 * (features @ weights - 0.5) @ features / len(x)
            seen.extend(batch.keys)
        assert sorted(seen) == keys, "every sample exactly once per epoch"
    assert client.next() is None, "the sidecar is done after --epochs"
    assert np.all(np.isfinite(weights)) and np.any(weights != 0)
    client.close()


def test_torch_tensors_on_cpu(env):
    torch = pytest.importorskip("torch")
    env.dataset(8)
    sc = env.sidecar("--batch-size", "4", "--width", "16", "--height", "16", "--epochs", "1")
    client = stoker.Client(sc.socket, connect_timeout=10)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for batch in stoker.batches(client):
        x = batch.torch(device="cpu")
        assert x.dtype == torch.uint8 and tuple(x.shape) == (4, 16, 16, 3)
        feats = x.float().mean(dim=(1, 2)) / 255.0
        loss = (model(feats) - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    assert steps == 2
    if not torch.cuda.is_available():
        assert client.info["gpu"]["placement"] == "off"
    client.close()


def test_corrupt_objects_arrive_as_skips_with_metadata(env):
    env.dataset(3)
    env.put("broken.png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    manifest = env.tmp / "train.jsonl"
    lines = ['{"key": "img-%04d.png", "label": %d}' % (i, i) for i in range(3)]
    lines += ['{"key": "broken.png", "label": 9}', '{"key": "gone.png", "label": 10}']
    manifest.write_text("\n".join(lines) + "\n")
    sc = env.sidecar(
        "--manifest", str(manifest), "--batch-size", "5", "--no-shuffle", "--epochs", "1",
        "--width", "64", "--height", "48",
    )
    client = stoker.Client(sc.socket, connect_timeout=10)
    seen = 0
    for batch in stoker.batches(client):
        seen += 1
        assert batch.keys == ["img-0000.png", "img-0001.png", "img-0002.png"]
        assert [m["label"] for m in batch.metadata] == [0, 1, 2]
        skips = dict(batch.skips)
        assert skips["gone.png"] == "not_found"
        assert skips["broken.png"] in ("corrupt", "truncated")
        assert batch.array.shape == (3, 48, 64, 3)
    assert seen == 1


def test_missing_sidecar_is_a_clear_error_not_a_hang(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(stoker.SidecarUnavailable, match="no stoker sidecar"):
        stoker.Client(str(tmp_path / "nope.sock"), connect_timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_dead_sidecar_is_a_clear_error_not_a_hang(env):
    env.dataset(8)
    sc = env.sidecar("--batch-size", "2", "--width", "16", "--height", "16")
    client = stoker.Client(sc.socket, connect_timeout=10, next_timeout=2)
    first = client.next()
    first.release()
    sc.kill9()
    t0 = time.monotonic()
    with pytest.raises(stoker.SidecarUnavailable):
        for _ in range(10):
            item = client.next()
            if isinstance(item, stoker.Batch):
                item.release()
    assert time.monotonic() - t0 < 15


def test_example_training_script_runs(env):
    env.dataset(12)
    sc = env.sidecar("--batch-size", "4", "--width", "32", "--height", "32")
    example = os.path.join(HERE, "..", "examples", "train.py")
    run_env = dict(os.environ, STOKER_SOCKET=sc.socket)
    out = subprocess.run([sys.executable, example, "--epochs", "2"], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "epoch 1" in out.stdout and "data wait" in out.stdout, out.stdout


def test_starved_pipeline_is_a_data_timeout_not_a_hang(env):
    env.dataset(4)
    # The only worker does not exist and local decode is off: nothing can become ready.
    sc = env.sidecar("--batch-size", "2", "--no-local-fallback", workers=["127.0.0.1:1"])
    client = stoker.Client(sc.socket, connect_timeout=10, next_timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(stoker.DataTimeout, match="no batch ready"):
        client.next()
    assert 1.0 < time.monotonic() - t0 < 10


def test_a_source_the_sidecar_cannot_read_raises_source_unavailable(tmp_path):
    """The reply the sidecar sends when S3 refuses access (its e2e test makes the real one):
    the client raises SourceUnavailable with the sidecar's words, not a generic error."""
    import json
    import socket
    import threading

    ring = tmp_path / "ring.bin"
    ring.write_bytes(b"\0" * 4096)
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    message = "s3://data/a.jpg: access refused or no such bucket"

    def sidecar():
        conn, _ = server.accept()
        lines = conn.makefile("rb")
        for line in lines:
            op = json.loads(line)["op"]
            if op == "hello":
                reply = {"type": "hello", "shm_path": str(ring), "slots": 1, "slot_bytes": 4096}
            else:
                reply = {"type": "source_unavailable", "message": message}
            conn.sendall((json.dumps(reply) + "\n").encode())

    threading.Thread(target=sidecar, daemon=True).start()
    client = stoker.Client(path, connect_timeout=5)
    with pytest.raises(stoker.SourceUnavailable, match="access refused"):
        client.next(timeout=5)
    client.close()
    server.close()
