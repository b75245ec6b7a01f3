"""A plain PyTorch (DDP) loop fed by stoker, with checkpoint and resume.

    torchrun --nproc-per-node 8 checkpoint_loop.py --ckpt /ckpt/run1 --epochs 10

Each rank reads its own shard from its local-rank socket ($STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock;
RANK and WORLD_SIZE go to the sidecar in hello). Every --save-every steps rank 0 writes the
model, the optimizer and the loader's state_dict in one file, atomically. After a crash (or a
restart with another world size: the sidecar re-shards the rest of the epoch) every rank loads
that file and continues with exactly the samples not yet trained on.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stoker.torch


def save_atomic(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill during the save leaves the previous checkpoint whole


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint directory")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--side", type=int, default=448, help="the sidecar's --width and --height (crop)")
    ap.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    args = ap.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    is_main = not distributed or dist.get_rank() == 0

    # crop/fit: batch["images"] is uint8 (n, H, W, 3) on the device; normalize there.
    loader = stoker.torch.Loader(device=device)
    net = torch.nn.Linear(3 * args.side * args.side, 10).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    path = os.path.join(args.ckpt, "last.pt")
    step = 0
    if os.path.exists(path):
        ckpt = torch.load(path, map_location=device)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        # Rank 0's loader state serves every rank: all ranks stand at the same (epoch, position),
        # whatever the world size was.
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
    model = DistributedDataParallel(net) if distributed else net

    os.makedirs(args.ckpt, exist_ok=True)
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a mid-epoch resume: the loader already stands in `epoch`
        for batch in loader:
            x = batch["images"].permute(0, 3, 1, 2).float().div_(255).flatten(1)
            labels = torch.tensor([m.get("label", 0) for m in batch["metadata"]], device=device)
            loss = torch.nn.functional.cross_entropy(model(x), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % args.save_every == 0 and is_main:
                # After the step: the state counts exactly the batches the model has learned from.
                save_atomic({"model": net.state_dict(), "optimizer": opt.state_dict(),
                             "loader": loader.state_dict(), "step": step}, path)
        if is_main:
            print("epoch %d done at step %d, data wait %.1fs" % (epoch, step, loader.client.data_wait_s))
    loader.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
