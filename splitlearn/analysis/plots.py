"""PNG plots of a report (matplotlib, Agg): :func:`plot_segments` (per segment parameters, GMACs,
latency and its submodules stacked) and :func:`plot_sweep` (per cut, each side's GMACs, the
bytes crossing and the estimated step time)."""
from __future__ import annotations

import re
from pathlib import Path


def _pyplot():
    from .._extras import require

    require("analysis", "matplotlib", what="plotting")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_segments(report: dict, path: str | Path) -> Path:
    plt = _pyplot()
    segs = report["segments"]
    names = [s["name"] for s in segs]
    timed = all(s["latency_ms"] is not None for s in segs)  # the meta device times nothing
    fig, axes = plt.subplots(1, 4 if timed else 2, figsize=(16 if timed else 8, 4))
    for ax, key, label, scale in ((axes[0], "params", "parameters (M)", 1e6),
                                  (axes[1], "macs", "GMACs", 1e9)):
        ax.bar(names, [s[key] / scale for s in segs], color="tab:blue")
        ax.set_title(label)
    if timed:
        _latency_axes(axes[2], axes[3], segs, names)
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']} cuts {cfg['cuts']} {cfg['mode']} B={cfg['batch_size']} "
                 f"T={cfg['seq_len']} on {report['device']['type']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _latency_axes(ax_total, ax, segs: list, names: list) -> None:
    """Each segment's latency, and its top-level submodules' medians stacked."""
    ax_total.bar(names, [s["latency_ms"]["median"] for s in segs], color="tab:orange",
                 yerr=[[0] * len(segs), [s["latency_ms"]["p90"] - s["latency_ms"]["median"] for s in segs]])
    ax_total.set_title("latency ms (median, bar to p90)")
    for i, s in enumerate(segs):
        bottom = 0.0
        for sub in (x for x in s["submodules"] if not x["parent"]):
            v = sub["latency_ms"]["median"]
            ax.bar(i, v, bottom=bottom, color=_color(sub["name"]), edgecolor="white")
            if v > 0.08 * s["latency_ms"]["median"]:
                ax.text(i, bottom + v / 2, sub["name"], ha="center", va="center", fontsize=7)
            bottom += v
        ax.plot([i - 0.4, i + 0.4], [s["latency_ms"]["median"]] * 2, color="black")
    ax.set_xticks(range(len(segs)), names)
    ax.set_title("submodule medians (line: segment)")


_OTHER = ("tab:purple", "tab:pink", "tab:gray", "tab:olive", "tab:cyan", "tab:brown")


def _color(name: str) -> str:
    """Layers (``<list>.<i>``, any family's name for the list) green, the head red, the other
    rows (embeddings, rotary, norms) a colour of their own."""
    if re.fullmatch(r"[\w.]+\.\d+", name):
        return "tab:green"
    if name == "lm_head":
        return "tab:red"
    return _OTHER[sum(map(ord, name)) % len(_OTHER)]


def plot_sweep(sweep: dict, path: str | Path) -> Path:
    plt = _pyplot()
    pts = sweep["points"]
    cuts = [p["cut"] for p in pts]
    wire = sweep["link"]["wire_dtype"]
    has_step = "step_ms" in pts[0]
    fig, axes = plt.subplots(1, 2 if has_step else 1, figsize=(13 if has_step else 7, 4), squeeze=False)
    ax = axes[0][0]
    w = 0.4
    ax.bar([c - w / 2 for c in cuts], [p["client_macs"] / 1e9 for p in pts], w, label="client GMACs")
    ax.bar([c + w / 2 for c in cuts], [p["server_macs"] / 1e9 for p in pts], w, label="server GMACs")
    ax.set_xlabel("cut (blocks on the client)")
    ax.set_ylabel("GMACs")
    ax2 = ax.twinx()
    ax2.plot(cuts, [p["bytes"][wire] / 1024 for p in pts], "k.-", label=f"KiB crossing ({wire})")
    ax2.set_ylabel("KiB crossing the cut")
    ax2.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_title("compute per side vs bytes crossing")
    if has_step:
        ax = axes[0][1]
        ax.plot(cuts, [p["step_ms"] for p in pts], "o-", label="step")
        ax.plot(cuts, [p["transfer_ms"] for p in pts], "--", label="transfer")
        rec = sweep.get("recommendation")
        if rec:
            ax.axvline(rec["cut"], color="tab:red", ls=":", label=f"recommended cut {rec['cut']}")
        ax.set_xlabel("cut")
        ax.set_ylabel("ms")
        ax.set_title("estimated step time")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
