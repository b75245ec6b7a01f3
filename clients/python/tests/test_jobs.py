"""Whole jobs: trainer processes (trainer_proc.py) with torchrun's environment against real
sidecars: every sample of every epoch exactly once across the ranks, through kill -9 of a
trainer, an elastic resize, and a trainer running as another user than the sidecar."""

import collections
import os
import shutil
import signal
import stat
import tempfile
import threading
import time

import pytest

from conftest import read_record, vm_rss_bytes, wait_all

TINY = ["--width", "8", "--height", "8"]


def trained(records, epoch):
    """Samples of `epoch` trained across the records, with multiplicity."""
    return collections.Counter(k for r in records for k in r["trained"].get(str(epoch), []))


def assert_exactly_once(records, epoch, keys):
    counts = trained(records, epoch)
    missing = sorted(set(keys) - set(counts))
    repeated = sorted(k for k, n in counts.items() if n > 1)
    assert not missing and not repeated, "epoch %d: %d missing %s, %d repeated %s" % (
        epoch, len(missing), missing[:5], len(repeated), repeated[:5])
    assert set(counts) == set(keys)


class RssWatch:
    """Samples VmRSS of processes every 50 ms; `peak` is the largest seen per pid."""

    def __init__(self, pids):
        self.peak = {pid: 0 for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            for pid in self.peak:
                try:
                    self.peak[pid] = max(self.peak[pid], vm_rss_bytes(pid))
                except (OSError, KeyError):
                    pass
            self._stop.wait(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak


# Debug build, 8 rings of 10 slots of 4 KiB, 256 samples, 8 trainer connections over 2 epochs:
# peak VmRSS measured 25 MB per sidecar. The bound, 128 MB, is five
# times that: allocator noise passes, a per-connection copy of the dataset or of the decode pool
# does not.
SIDECAR_RSS_BOUND = 128 << 20


def test_two_pods_of_eight_ranks_deliver_every_sample_once_per_epoch(env, tmp_path):
    keys = env.dataset(256, width=16, height=16)
    pods = []
    for node in range(2):
        shm = tmp_path / ("pod-%d" % node)
        shm.mkdir()
        pods.append(env.sidecar(
            "--local-ranks", "8", "--node-rank", str(node), "--world-size", "16",
            "--batch-size", "4", "--epochs", "2", *TINY, shm=shm,
        ))
    assert all(len(p.sockets) == 8 for p in pods)
    watch = RssWatch([p.p.pid for p in pods])
    trainers, outs = [], []
    for rank in range(16):
        node, local = divmod(rank, 8)
        out = tmp_path / ("rank-%d.json" % rank)
        outs.append(out)
        # No STOKER_SOCKET: the client finds $STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock.
        trainers.append(env.trainer(out, "--epochs", "2", rank=rank, world_size=16, local_rank=local,
                                    shm=pods[node].shm))
    wait_all(trainers, timeout=120)
    peak = watch.stop()
    records = [read_record(o) for o in outs]
    for epoch in range(2):
        assert_exactly_once(records, epoch, keys)
    for r in records:
        assert r["lens"] == {"0": 4, "1": 4}, "256 samples / 16 ranks / batch 4"
        assert (r["state"]["epoch"], r["state"]["position"]) == (2, 0)
    print("sidecar peak VmRSS: %s MB" % [round(v / 2**20) for v in peak.values()])
    assert all(0 < v < SIDECAR_RSS_BOUND for v in peak.values()), peak


def wait_for_batches(out, n, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("trainer exited early: %s" % proc.communicate()[1][-2000:])
        try:
            if read_record(out)["batches"] >= n:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError("trainer wrote fewer than %d batches in %ds" % (n, timeout))


def test_a_trainer_killed_mid_epoch_resumes_from_its_state_and_nothing_is_lost_or_repeated(env, tmp_path):
    keys = env.dataset(96, width=16, height=16)
    sc = env.sidecar("--local-ranks", "4", "--world-size", "4", "--batch-size", "4", "--epochs", "1", *TINY)
    outs = [tmp_path / ("rank-%d.json" % r) for r in range(4)]

    def start(rank, *extra):
        return env.trainer(outs[rank], "--epochs", "1", "--step-s", "0.1", *extra,
                           rank=rank, world_size=4, local_rank=rank, shm=sc.shm)

    trainers = [start(r) for r in range(4)]
    victim = 1
    # 6 batches a rank; kill after the second is saved, while it trains on the third.
    wait_for_batches(outs[victim], 2, trainers[victim])
    time.sleep(0.05)
    trainers[victim].send_signal(signal.SIGKILL)
    trainers[victim].wait()
    saved = read_record(outs[victim])
    assert 2 <= saved["batches"] < 6, "killed mid-epoch"
    trainers[victim] = start(victim, "--resume")
    wait_all(trainers, timeout=90)
    records = [read_record(o) for o in outs]
    assert_exactly_once(records, 0, keys)
    assert read_record(outs[victim])["batches"] == 6


def test_an_elastic_resize_from_four_ranks_to_three_delivers_every_sample_once(env, tmp_path):
    # 144 samples, batch 4: the checkpoint after 3 batches of 4 ranks is at position 48, and
    # the 96 samples left divide by 3 ranks (32 each, 8 batches); epoch 1 gives 12 batches each.
    keys = env.dataset(144, width=16, height=16)
    sc = env.sidecar("--local-ranks", "4", "--world-size", "4", "--batch-size", "4", "--epochs", "2", *TINY)
    outs = [tmp_path / ("rank-%d.json" % r) for r in range(4)]
    before = [env.trainer(outs[r], "--epochs", "2", "--max-batches", "3", rank=r, world_size=4, local_rank=r,
                          shm=sc.shm) for r in range(4)]
    wait_all(before, timeout=60)
    states = [read_record(o)["state"] for o in outs]
    assert {(s["epoch"], s["position"], s["world_size"]) for s in states} == {(0, 48, 4)}

    # The same sidecar; three new processes say RANK/WORLD_SIZE 3 in hello and resume.
    after = [env.trainer(outs[r], "--epochs", "2", "--resume", rank=r, world_size=3, local_rank=r, shm=sc.shm)
             for r in range(3)]
    wait_all(after, timeout=90)
    records = [read_record(o) for o in outs]
    assert_exactly_once(records, 0, keys)
    assert_exactly_once(records, 1, keys)
    for r in range(3):
        per_epoch = {e: len(records[r]["trained"][str(e)]) for e in (0, 1)}
        assert per_epoch == {0: 3 * 4 + 8 * 4, 1: 12 * 4}, per_epoch
        assert records[r]["lens"]["1"] == 12
        assert records[r]["state"]["world_size"] == 3


# The pod's fsGroup: the group the sidecar and the trainer share on the shared-memory volume.
FS_GROUP = 4242
SIDECAR_UID = 65532
TRAINER_UID = 1000


def executable_by_others(path):
    """Whether a user outside the file's owner and group can reach and run `path`."""
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(path)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


class SharedVolume:
    """A setgid shm dir (root:FS_GROUP, 2770) under a directory every uid can traverse, a
    sidecar binary uid 65532 can run (copied there when target/ is not reachable), and a
    world-writable dir for the trainers' records (pytest's tmp_path is root's alone)."""

    def __init__(self, env):
        self.base = tempfile.mkdtemp(prefix="stoker-fsgroup-")
        os.chmod(self.base, 0o711)
        self.shm = os.path.join(self.base, "shm")
        os.mkdir(self.shm)
        os.chown(self.shm, 0, FS_GROUP)
        os.chmod(self.shm, 0o2770)
        self.records = os.path.join(self.base, "records")
        os.mkdir(self.records)
        os.chmod(self.records, 0o777)
        self.loader = env.loader
        if not executable_by_others(self.loader):
            self.loader = os.path.join(self.base, "stoker-loader")
            shutil.copy(env.loader, self.loader)
            os.chmod(self.loader, 0o755)

    def sidecar(self, env, *flags):
        """A sidecar running as uid 65532 in the fs group, as the pod's securityContext makes it."""
        return env.sidecar(*flags, shm=self.shm, loader=self.loader, env={"HOME": self.base},
                           popen=dict(user=SIDECAR_UID, group=FS_GROUP, extra_groups=[]))


@pytest.fixture
def shared_volume(env):
    if os.geteuid() != 0:
        pytest.fail("the permission tests start processes as other users: run them as root")
    volume = SharedVolume(env)
    yield volume
    env.stop()
    shutil.rmtree(volume.base, ignore_errors=True)


def test_a_trainer_of_another_uid_in_the_fs_group_receives_batches(env, shared_volume):
    vol = shared_volume
    keys = env.dataset(16, width=16, height=16)
    vol.sidecar(env, "--batch-size", "4", "--epochs", "1", *TINY)
    files = os.listdir(vol.shm)
    assert any(f.endswith(".sock") for f in files) and any(not f.endswith(".sock") for f in files)
    assert all(os.stat(os.path.join(vol.shm, f)).st_gid == FS_GROUP for f in files), \
        "the setgid dir gives the ring and the socket the pod's group"
    out = os.path.join(vol.records, "rank-0.json")
    trainer = env.trainer(out, "--epochs", "1", "--drop-privileges", "%d:%d:%d" % (TRAINER_UID, TRAINER_UID, FS_GROUP),
                          local_rank=0, shm=vol.shm)
    wait_all([trainer], timeout=60)
    record = read_record(out)
    assert record["uid"] == TRAINER_UID
    assert_exactly_once([record], 0, keys)


def test_a_trainer_outside_the_fs_group_gets_a_permission_error_not_a_hang(env, shared_volume):
    vol = shared_volume
    env.dataset(8, width=16, height=16)
    vol.sidecar(env, "--batch-size", "4", *TINY)
    t0 = time.monotonic()
    trainer = env.trainer(os.path.join(vol.records, "rank-0.json"), "--drop-privileges",
                          "%d:%d" % (TRAINER_UID, TRAINER_UID), "--connect-timeout", "30", local_rank=0, shm=vol.shm)
    _, err = trainer.communicate(timeout=30)
    assert trainer.returncode != 0
    assert "PermissionDenied" in err and "fsGroup" in err, err[-2000:]
    assert time.monotonic() - t0 < 15, "a clear error well before the 30 s connect timeout"
