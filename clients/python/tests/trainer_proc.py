"""A trainer process for the multi-process tests, modelled on a real one.

It reads this rank's batches with :class:`stoker.Stream` (rank, world size and socket from
torchrun's environment) and, after "training" on each batch, writes its record atomically: the
state_dict and the samples trained so far, together. A sample therefore counts as trained only
with the state that follows it, as a real trainer's checkpoint holds the model and the loader
state of the same step: what a process consumed after its last write is lost on kill -9, and
its restart (``--resume``) gets it again.

    trainer_proc.py --out REC [--resume] [--epochs N] [--max-batches K] [--step-s S]
                    [--drop-privileges UID:GID[:GROUP,...]]
"""

import argparse
import json
import os
import sys
import time


def write_atomic(path, record):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def drop_privileges(spec):
    """Becomes UID:GID with the supplementary GROUPs (none when absent) before connecting: the
    process touches the socket and the ring with those credentials only."""
    parts = spec.split(":")
    uid, gid = int(parts[0]), int(parts[1])
    groups = [int(g) for g in parts[2].split(",")] if len(parts) > 2 and parts[2] else []
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true", help="load the state and samples of --out")
    ap.add_argument("--epochs", type=int, default=1, help="train until this epoch (absolute)")
    ap.add_argument("--max-batches", type=int, default=0, help="exit after this many batches")
    ap.add_argument("--step-s", type=float, default=0.0, help="simulated compute per batch")
    ap.add_argument("--connect-timeout", type=float, default=30.0)
    ap.add_argument("--drop-privileges", default="")
    args = ap.parse_args()

    import stoker  # imported as the starting user: the venv may be unreadable to the target one

    if args.drop_privileges:
        drop_privileges(args.drop_privileges)

    stream = stoker.Stream(connect_timeout=args.connect_timeout, next_timeout=60)
    record = {"state": None, "trained": {}, "batches": 0, "lens": {}, "uid": os.getuid()}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            record.update(json.load(f))
        if record["state"] is not None:
            stream.load_state_dict(record["state"])
    batches = 0
    while stream.epoch < args.epochs:
        epoch = stream.epoch
        stream.set_epoch(epoch)
        record["lens"][str(epoch)] = len(stream)
        got = 0
        for batch in stream:
            got += 1
            time.sleep(args.step_s)
            assert batch.array.shape[0] == len(batch.keys)
            record["trained"].setdefault(str(batch.epoch), []).extend(batch.keys)
            record["state"] = stream.state_dict()
            record["batches"] += 1
            write_atomic(args.out, record)
            batches += 1
            if args.max_batches and batches >= args.max_batches:
                return
        record["state"] = stream.state_dict()
        write_atomic(args.out, record)
        if got == 0 and stream.epoch == epoch:
            print("the sidecar is done before epoch %d" % args.epochs, file=sys.stderr)
            sys.exit(3)
    stream.close()


if __name__ == "__main__":
    main()
