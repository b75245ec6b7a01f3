"""PyTorch Lightning fed by stoker.

    torchrun --nproc-per-node 8 lightning_module.py --out /ckpt/run1

`train_dataloader` returns the Loader: any iterable with `len` works there, and it is this
rank's shard already, so `use_distributed_sampler=False` (Lightning must not try to put a
DistributedSampler in front of it). Lightning saves the state_dict of a loader that has one in
each checkpoint and loads it on resume (`ckpt_path="last"`), on every rank.

`lookahead=1`: Lightning's fetcher holds one batch ahead of the training step, so when a
checkpoint is written after step k the Loader has handed over batch k+1 too; with lookahead=1
its state_dict leaves that batch out, and the resume trains on it.

Lightning up to 2.5 forgets loader states when `configure_optimizers` reads
`trainer.estimated_stepping_batches` (Lightning-AI/pytorch-lightning#20550): give a scheduler
its total steps from `len(loader)` instead, as below.
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import stoker.torch


class Classifier(L.LightningModule):
    def __init__(self, side: int = 448, classes: int = 10, epochs: int = 1):
        super().__init__()
        self.net = torch.nn.Linear(3 * side * side, classes)
        self.epochs = epochs
        self.loader = None

    def train_dataloader(self):
        if self.loader is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
            self.loader = stoker.torch.Loader(device=device, lookahead=1)
        return self.loader

    def training_step(self, batch, batch_idx):
        x = batch["images"].permute(0, 3, 1, 2).float().div_(255).flatten(1)
        labels = torch.tensor([m.get("label", 0) for m in batch["metadata"]], device=x.device)
        loss = torch.nn.functional.cross_entropy(self.net(x), labels)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = self.epochs * len(self.train_dataloader())  # not trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()

    # Under torchrun: one process per GPU, the layout the sidecar's sockets follow.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="auto",
        devices=local_world,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local_world,
        strategy="ddp",
        use_distributed_sampler=False,
        default_root_dir=args.out,
        callbacks=[ModelCheckpoint(dirpath=args.out, save_last=True, every_n_train_steps=200)],
    )
    trainer.fit(Classifier(epochs=args.epochs), ckpt_path="last" if os.path.exists(os.path.join(args.out, "last.ckpt")) else None)


if __name__ == "__main__":
    main()
