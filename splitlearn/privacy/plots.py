"""Token recovery against perplexity, one line per cut through the defense strengths."""
from __future__ import annotations

from pathlib import Path


def plot_privacy(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """PNG of :meth:`~.meter.LeakageReport.as_dict` rows: x = perplexity with the defense,
    y = token recovery of the best attack; per cut, one line each for the defense at test time
    (from the undefended point), fine-tuned with the defense, and fine-tuned with the residual
    design, joining the noise-only points in order of sigma (NoPeek, combinations and the
    fine-tuned control as open markers), each point labelled; the undefended perplexity and the
    targets (1.5x it, recovery 0.25) as lines."""
    from .._extras import require

    require("analysis", "matplotlib", what="plotting")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    cuts = sorted({tuple(r["cut"]) for r in rows})
    styles = {"test time": ("o", "-"), "fine-tuned": ("s", "--"), "fine-tuned, residual": ("^", ":")}
    colors = {}
    for cut in cuts:
        label = f"cut {cut[0]}" if len(cut) == 1 else f"U-shape {cut[0]},{cut[1]}"
        none = [r for r in rows if tuple(r["cut"]) == cut and r["defense"]["name"] == "none"
                and not r.get("defense_trained")]
        for kind, (marker, ls) in styles.items():
            pts = sorted((r for r in rows if tuple(r["cut"]) == cut and _kind(r) == kind),
                         key=lambda r: (r["defense"].get("sigma", -1.0), r["defense"].get("weight", -1.0)))
            pts = (none + pts) if kind == "test time" else pts
            if not pts:
                continue
            # the line joins the noise-only points in order of sigma; the others are points alone
            joined = [r for r in pts if r["defense"]["name"] in ("none", "gaussian")
                      and (kind == "test time" or r["defense"]["name"] == "gaussian")]
            alone = [r for r in pts if r not in joined]
            line, = ax.plot([r["perplexity"] for r in joined], [r["token_recovery"] for r in joined],
                            marker=marker, ls=ls, color=colors.get(cut), label=f"{label}, {kind}")
            colors.setdefault(cut, line.get_color())
            ax.plot([r["perplexity"] for r in alone], [r["token_recovery"] for r in alone], marker=marker,
                    ls="", color=line.get_color(), mfc="none")
            for r in pts:
                ax.annotate(_short(r), (r["perplexity"], r["token_recovery"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=line.get_color())
    if rows:
        undefended = rows[0].get("perplexity_undefended") or rows[0]["perplexity_unsplit"]
        ax.axvline(undefended, color="gray", ls=":", label="undefended perplexity")
        ax.axvline(1.5 * undefended, color="red", ls=":", lw=0.8, label="target: 1.5x undefended")
        ax.axhline(0.25, color="red", ls="--", lw=0.8, label="target: best attack <= 0.25")
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


def _kind(r: dict) -> str:
    if not r.get("defense_trained"):
        return "test time"
    return "fine-tuned, residual" if r["defense"].get("residual") else "fine-tuned"


def _short(r: dict) -> str:
    d = r["defense"]
    parts = ([f"σ={d['sigma']:g}"] if "sigma" in d else []) + ([f"NoPeek {d['weight']:g}"] if "weight" in d else [])
    return ", ".join(parts) or ("none, fine-tuned" if r.get("defense_trained") else "none")
