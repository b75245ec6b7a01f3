"""Fine-tune Qwen2.5-VL on captions with the Hugging Face Trainer, fed by stoker.

    torchrun --nproc-per-node 8 hf_trainer.py --model Qwen/Qwen2.5-VL-3B-Instruct --out /ckpt/qwen

The sidecar runs with `--resize qwenSmart --factor 28` (and the --min-pixels/--max-pixels the
model was trained with); the manifest's metadata carries a "caption" per image. The Loader yields
the vision input already made on the GPU (pixel_values, image_grid_thw); the collate below adds
the text.

How the loader reaches the Trainer, and why:
- `get_train_dataloader` returns the Loader as it is. The default one wraps the dataset in a
  DataLoader and calls `accelerator.prepare`, which for an iterable either reads every batch on
  rank 0 and broadcasts it (`dispatch_batches`, the default for iterables) or keeps every
  world-th batch of each rank (`IterableDatasetShard`). Both are wrong for a loader that is
  already this rank's shard, so it must not go through `prepare`.
- `accelerator_config` sets `dispatch_batches=False, split_batches=False` so that loaders that
  do go through `prepare` (evaluation) are sharded by sampler, never dispatched.
- `ignore_data_skip=True`: on resume the Trainer would otherwise skip the trained batches by
  reading them again; the Loader resumes itself from its state_dict (saved by the callback
  next to each checkpoint).
- `set_epoch` is ignored: the Trainer derives its epoch from the step count, which after an
  elastic resize no longer matches the loader's epoch; the loader moves on by itself.
"""

import argparse
import json
import os

import torch
from transformers import (
    AutoProcessor,
    Qwen2_5_VLForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

import stoker
import stoker.torch

STATE_FILE = "stoker_state.json"


class TrainerLoader(stoker.torch.Loader):
    def set_epoch(self, epoch: int) -> None:
        pass


class StokerTrainer(Trainer):
    def __init__(self, *args, loader: stoker.torch.Loader, **kwargs):
        super().__init__(*args, **kwargs)
        self.loader = loader

    def get_train_dataloader(self):
        return self.loader  # this rank's shard already: never through accelerator.prepare


class SaveLoaderState(TrainerCallback):
    """Writes the loader's state into each checkpoint directory (rank 0's serves every rank)."""

    def __init__(self, loader: stoker.torch.Loader):
        self.loader = loader

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            ckpt = os.path.join(args.output_dir, "checkpoint-%d" % state.global_step)
            with open(os.path.join(ckpt, STATE_FILE), "w") as f:
                json.dump(self.loader.state_dict(), f)


def caption_collate(processor, merge_size: int = 2):
    """The Loader's dict -> the model's inputs: chat text with one <|image_pad|> per merged
    patch (what Qwen2VLProcessor inserts), labels on the caption tokens only."""
    tok = processor.tokenizer
    pad_id = tok.convert_tokens_to_ids("<|image_pad|>")

    def collate(batch):
        texts = []
        for (t, h, w), meta in zip(batch["image_grid_thw"].tolist(), batch["metadata"]):
            messages = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
                {"role": "assistant", "content": [{"type": "text", "text": meta["caption"]}]},
            ]
            text = processor.apply_chat_template(messages, tokenize=False)
            texts.append(text.replace("<|image_pad|>", "<|image_pad|>" * (t * h * w // merge_size**2), 1))
        enc = tok(texts, padding=True, return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[(enc["attention_mask"] == 0) | (labels == pad_id)] = -100
        device = batch["pixel_values"].device
        return {
            "input_ids": enc["input_ids"].to(device),
            "attention_mask": enc["attention_mask"].to(device),
            "labels": labels.to(device),
            "pixel_values": batch["pixel_values"],
            "image_grid_thw": batch["image_grid_thw"],
        }

    return collate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=float, default=1.0)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    processor = AutoProcessor.from_pretrained(args.model)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    # Qwen2/2.5-VL: patch 14, CLIP mean/std (stoker.QWEN2_VL). Qwen3-VL: stoker.QWEN3_VL, --factor 32.
    loader = TrainerLoader(device=torch.device("cuda", local_rank), qwen=stoker.QWEN2_VL,
                           collate=caption_collate(processor))

    training_args = TrainingArguments(
        output_dir=args.out,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=int(loader.info["batch_size"]),  # informational: the sidecar batches
        learning_rate=1e-5,
        bf16=True,
        save_steps=500,
        logging_steps=10,
        ignore_data_skip=True,
        remove_unused_columns=False,
        dataloader_pin_memory=False,  # batches arrive on the GPU from the pinned ring
        accelerator_config={"dispatch_batches": False, "split_batches": False},
        report_to=[],
    )
    trainer = StokerTrainer(model=model, args=training_args, loader=loader, callbacks=[SaveLoaderState(loader)])

    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    if last and os.path.exists(os.path.join(last, STATE_FILE)):
        with open(os.path.join(last, STATE_FILE)) as f:
            loader.load_state_dict(json.load(f))
    trainer.train(resume_from_checkpoint=last)
    loader.close()


if __name__ == "__main__":
    main()
