"""A toy training loop fed by the stoker sidecar.

Run inside a trainer pod (the socket is $STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock), or locally
next to `stoker-loader sidecar` with STOKER_SOCKET. Uses torch when installed (the GPU when
present), numpy otherwise. checkpoint_loop.py adds checkpoint and resume.
"""

import argparse
import time

import numpy as np

import stoker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.0, help="simulated compute per step")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        torch = None

    client = stoker.Client()
    print("ring: %d slots of %d bytes, rank %d/%d, gpu placement %s"
          % (client.info["slots"], client.info["slot_bytes"], client.info["rank"],
             client.info["world_size"], client.info["gpu"]["placement"]))
    if torch is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = torch.nn.Linear(3, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        weights = np.zeros(3)

    start = time.monotonic()
    for epoch in range(args.epochs):
        samples = 0
        for batch in stoker.batches(client):
            if torch is not None:
                x = batch.torch()  # uint8 on the device; normalize there, not on the CPU
                feats = x.float().mean(dim=(1, 2)) / 255.0
                loss = (model(feats) - 0.5).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                feats = batch.array.reshape(len(batch), -1, 3).mean(axis=1) / 255.0
                weights -= 0.01 * (feats @ weights - 0.5) @ feats / len(batch)
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
            samples += len(batch) + len(batch.skips)
        wall = time.monotonic() - start
        print("epoch %d: %d samples, data wait %.1f%% of %.1fs"
              % (epoch, samples, 100 * client.data_wait_s / wall, wall))
    client.close()


if __name__ == "__main__":
    main()
