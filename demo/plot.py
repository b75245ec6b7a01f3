"""Plots the demo's timeline: GPU busy and data wait %, decoders and nodes, busiest NIC %."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(timeline_path, png_path):
    report = json.load(open(timeline_path))
    ticks = report["ticks"]
    t = [x["t"] for x in ticks]
    # A tick without a trainer report (its pod starting, or one batch taking the whole tick)
    # is a gap, not 0 % busy and 0 % waiting.
    reported = [x["busy_pct"] + x["wait_pct"] > 0 for x in ticks]
    gap = float("nan")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    busy = [x["busy_pct"] if r else gap for x, r in zip(ticks, reported)]
    wait = [x["wait_pct"] if r else gap for x, r in zip(ticks, reported)]
    ax1.plot(t, busy, label="GPU busy %", color="tab:green", lw=2, marker=".")
    ax1.plot(t, wait, label="data wait %", color="tab:red", marker=".")
    ax1.plot(t, [x["busiest_nic_pct"] for x in ticks], label="busiest NIC %", color="tab:orange", ls="--")
    ax1.set_ylim(0, 105)
    ax1.set_ylabel("%")
    ax1.legend(loc="lower right")
    ax2.step(t, [x["decoders"] for x in ticks], where="post", label="decoders (ready)", color="tab:blue")
    ax2.step(t, [x["nodes"] for x in ticks], where="post", label="nodes with decoders", color="tab:purple")
    ax2.set_ylabel("count")
    ax2.set_xlabel("seconds")
    ax2.legend(loc="lower right")
    marks = [("dataloader", " PyTorch DataLoader"), ("pipeline", " DataPipeline applied")]
    for phase, text in marks:
        start = next((x["t"] for x in ticks if x["phase"] == phase), None)
        if start is None:
            continue
        for ax in (ax1, ax2):
            ax.axvline(start, color="grey", ls=":")
        ax1.text(start, 101, text, fontsize=8, va="bottom")
    for ax in (ax1, ax2):
        for d in report["decisions"]:
            ax.axvline(d["t"], color="tab:blue", alpha=0.25)
    before = [
        "%.0f%% (%s)" % (report[key], name)
        for key, name in (("baseline_busy_pct", "synchronous"), ("dataloader_busy_pct", "DataLoader"))
        if report.get(key) is not None
    ]
    ax1.set_title(
        "stoker demo: GPU busy %s%.0f%% (fed by stoker)"
        % ("".join(b + " → " for b in before), report["final_busy_pct"])
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
