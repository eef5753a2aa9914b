"""Token recovery against perplexity, one line per cut through the defense strengths."""
from __future__ import annotations

from pathlib import Path


def plot_privacy(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """PNG of :meth:`~.meter.LeakageReport.as_dict` rows: x = perplexity with the defense,
    y = token recovery of the best attack; points of one cut joined in order of sigma and
    labelled with it; the unsplit perplexity as a dotted line."""
    from .._extras import require

    require("analysis", "matplotlib", what="plotting")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    cuts = sorted({tuple(r["cut"]) for r in rows})
    for cut in cuts:
        pts = sorted((r for r in rows if tuple(r["cut"]) == cut),
                     key=lambda r: r["defense"].get("sigma", -1.0))
        label = f"cut {cut[0]}" if len(cut) == 1 else f"U-shape {cut[0]},{cut[1]}"
        line, = ax.plot([r["perplexity"] for r in pts], [r["token_recovery"] for r in pts],
                        "o-", label=label)
        for r in pts:
            s = r["defense"].get("sigma")
            ax.annotate("none" if s is None else f"σ={s:g}", (r["perplexity"], r["token_recovery"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
    if rows:
        ax.axvline(rows[0]["perplexity_unsplit"], color="gray", ls=":", label="unsplit perplexity")
    ppl = [r["perplexity"] for r in rows]
    if ppl and max(ppl) > 3 * min(ppl):
        ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("perplexity on private text, defense in place")
    ax.set_ylabel("token recovery, best attack (top-1)")
    ax.set_title(title or "what the server reads back vs what the defense costs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
