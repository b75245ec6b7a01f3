"""A training loop with Hugging Face Accelerate, fed by stoker, with save_state/load_state.

    accelerate launch --num-processes 8 accelerate_loop.py --out /ckpt/run1

The Loader is already this rank's shard, so it is not passed to `accelerator.prepare` (which
would dispatch batches from rank 0 or keep only every world-th batch of an iterable): only the
model and the optimizer are. `dispatch_batches=False, split_batches=False` keep any loader that
is prepared (evaluation) sharded by sampler. `register_for_checkpointing(loader)` puts the
loader's state_dict into `save_state` (written by the main process; every rank stands at the same
position, so it serves all) and seeks every rank on `load_state`.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

import stoker.torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--side", type=int, default=448, help="the sidecar's --width and --height (crop)")
    ap.add_argument("--save-every", type=int, default=200)
    args = ap.parse_args()

    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False, split_batches=False),
        project_config=ProjectConfiguration(project_dir=args.out, automatic_checkpoint_naming=True),
    )
    loader = stoker.torch.Loader(device=accelerator.device)
    model = torch.nn.Linear(3 * args.side * args.side, 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader
    accelerator.register_for_checkpointing(loader)

    checkpoints = os.path.join(args.out, "checkpoints")
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        accelerator.load_state()  # the latest: model, optimizer, RNG, and the loader (a seek)

    step = 0
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a mid-epoch resume
        for batch in loader:
            x = batch["images"].permute(0, 3, 1, 2).float().div_(255).flatten(1)
            labels = torch.tensor([m.get("label", 0) for m in batch["metadata"]], device=x.device)
            loss = torch.nn.functional.cross_entropy(model(x), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            # Gradient accumulation through accelerator.accumulate needs a prepared loader to
            # know the epoch's last batch; accumulate by hand if you need it.
            if step % args.save_every == 0:
                accelerator.save_state()  # after the step: the loader's state matches the model
        accelerator.print("epoch %d: %d steps" % (epoch, step))
    loader.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
