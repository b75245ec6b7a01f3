"""stoker.Stream against a real sidecar: the state a trainer checkpoints, and resuming from it."""

import pytest

import stoker
from stoker.stream import StateMismatch

BATCH = ["--batch-size", "4", "--width", "16", "--height", "16"]


def keys_of_epoch(stream):
    return [k for batch in stream for k in batch.keys]


def test_hello_says_where_the_stream_stands(env):
    env.dataset(40)
    sc = env.sidecar(*BATCH, "--seed", "7")
    client = stoker.Client(sc.socket, connect_timeout=10, rank=0, world_size=1)
    info = client.info
    assert (info["rank"], info["world_size"]) == (0, 1)
    assert (info["epoch"], info["position"]) == (0, 0)
    assert (info["samples"], info["seed"], info["resize"]) == (40, 7, "crop")
    assert info["batches_per_epoch"] == 10
    client.close()


def test_a_new_connection_resumes_from_the_state_dict_exactly(env):
    keys = env.dataset(40)
    sc = env.sidecar(*BATCH)
    first = stoker.Stream(sc.socket, connect_timeout=10)
    assert len(first) == 10
    assert first.state_dict() == {
        "stoker": 1, "epoch": 0, "position": 0, "seed": 42, "batch_size": 4, "samples": 40,
        "world_size": 1, "rank": 0,
    }
    seen, positions = [], []
    for batch in first:
        seen.extend(batch.keys)
        positions.append(first.position)
        if len(positions) == 3:
            break
    assert positions == [4, 8, 12]
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (0, 12)
    # The sidecar prefetched past batch 3 for the first connection; the state is what counts.
    first.close()

    second = stoker.Stream(sc.socket, connect_timeout=10)
    second.load_state_dict(state)
    rest = keys_of_epoch(second)
    assert (second.epoch, second.position) == (1, 0), "after end_of_epoch E the state is (E+1, 0)"

    second.set_epoch(0)
    whole = keys_of_epoch(second)
    assert sorted(whole) == keys
    assert seen + rest == whole, "the resumed connection gets exactly the batches not yielded"
    second.close()


def test_set_epoch_keeps_a_mid_epoch_resume_and_seeks_otherwise(env):
    env.dataset(40)
    sc = env.sidecar(*BATCH)
    stream = stoker.Stream(sc.socket, connect_timeout=10)
    state = dict(stream.state_dict(), epoch=1, position=8)
    stream.load_state_dict(state)
    stream.set_epoch(1)  # what a training loop does at the top of the resumed epoch
    batch = next(iter(stream))
    assert (batch.epoch, batch.position) == (1, 12)
    stream.set_epoch(3)
    batch = next(iter(stream))
    assert (batch.epoch, batch.position) == (3, 4)
    assert stream.state_dict()["epoch"] == 3
    stream.close()


def test_lookahead_leaves_batches_fetched_ahead_out_of_the_state(env):
    env.dataset(40)
    sc = env.sidecar(*BATCH)
    # Lightning's fetcher holds one batch ahead: while batch k trains, k+1 has been yielded.
    stream = stoker.Stream(sc.socket, connect_timeout=10, lookahead=1)
    it = iter(stream)
    next(it)
    assert stream.state_dict()["position"] == 0, "batch 1 is fetched, not trained"
    next(it)
    next(it)
    assert stream.position == 12, "the stream stands after batch 3"
    assert stream.state_dict()["position"] == 8, "a checkpoint now resumes after batch 2"
    for _ in it:
        pass
    assert (stream.state_dict()["epoch"], stream.state_dict()["position"]) == (1, 0)
    stream.close()


@pytest.mark.parametrize("field", ["seed", "batch_size", "samples"])
def test_a_state_of_another_order_is_refused_naming_the_field(env, field):
    env.dataset(40)
    sc = env.sidecar(*BATCH)
    stream = stoker.Stream(sc.socket, connect_timeout=10)
    state = dict(stream.state_dict(), position=8)
    state[field] += 1
    with pytest.raises(StateMismatch, match="checkpoint's %s" % field):
        stream.load_state_dict(state)
    # The sidecar checks too (another client, or a state edited past this check).
    info = stream.info
    order = {"seed": info["seed"], "batch_size": info["batch_size"], "samples": info["samples"]}
    order[field] += 1
    with pytest.raises(stoker.StokerError, match=field):
        stream.client.seek(0, 8, **order)
    stream.close()


def test_malformed_states_are_clear_errors(env):
    env.dataset(40)
    sc = env.sidecar(*BATCH)
    stream = stoker.Stream(sc.socket, connect_timeout=10)
    good = stream.state_dict()
    with pytest.raises(StateMismatch, match="version 1"):
        stream.load_state_dict(dict(good, stoker=2))
    with pytest.raises(StateMismatch, match="lacks position"):
        stream.load_state_dict({k: v for k, v in good.items() if k != "position"})
    with pytest.raises(StateMismatch, match="outside the dataset"):
        stream.load_state_dict(dict(good, position=41))
    stream.close()


def test_torch_loader_yields_tensors_that_outlive_the_next_batch(env):
    torch = pytest.importorskip("torch")
    import stoker.torch

    keys = env.dataset(16)
    sc = env.sidecar(*BATCH, "--epochs", "1")
    loader = stoker.torch.Loader(sc.socket, device="cpu", connect_timeout=10)
    assert len(loader) == 4
    kept = []
    for batch in loader:
        assert batch["images"].dtype == torch.uint8 and tuple(batch["images"].shape) == (4, 16, 16, 3)
        kept.append((batch["images"], batch["images"].clone(), batch["keys"]))
    for images, snapshot, _ in kept:
        assert torch.equal(images, snapshot), "a yielded tensor is not overwritten by later batches"
    assert sorted(k for _, _, ks in kept for k in ks) == keys
    assert loader.state_dict()["epoch"] == 1
    loader.close()
