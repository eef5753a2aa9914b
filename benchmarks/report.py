"""Results of a run: ``results.json`` (everything), ``results.md`` (tables + targets), ``summary.png``.

The JSON holds ``machine``, ``config``, ``command``, ``started``, ``seconds`` and ``rows``:
one object per measurement with at least ``workload``, ``case``, ``system``, ``value``,
``unit`` and ``better`` ("higher" or "lower"), and ``ratio`` where a reference exists
(the unsplit model; one client for concurrency).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def _find(rows, workload, system, **match) -> Optional[dict]:
    for r in rows:
        if r["workload"] == workload and r["system"] == system and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def targets(result: dict) -> list[dict]:
    """Each target of the issues, with what this run measured and whether it was met."""
    rows, cfg = result["rows"], result["config"]
    out = []

    def add(name, row, key, op, limit, fmt="{:.3f}"):
        if row is None or row.get(key) is None:
            return
        v = row[key]
        out.append({"target": name, "measured": fmt.format(v), "met": v >= limit if op == ">=" else v <= limit})

    for b in cfg["gen_batches"]:
        add(f"generation batch {b}, U-shape float32: tokens/s >= 0.95x unsplit",
            _find(rows, "generation", "splitlearn u float32", batch=b), "ratio", ">=", 0.95, "{:.3f}x")
    add("training step, U-shape float32: time <= 1.05x unsplit" if cfg["device"] == "cpu"
        else "training step, U-shape float32 wire: time <= 1.15x unsplit",
        _find(rows, "training", "splitlearn u float32"), "ratio", "<=", 1.05 if cfg["device"] == "cpu" else 1.15,
        "{:.3f}x")
    codec = _find(rows, "codec", "splitlearn float32")
    add("codec float32 encode + decode >= 5 GB/s", codec, "value", ">=", 5.0, "{:.2f} GB/s")
    if codec:
        out.append({"target": "bytes on the wire <= raw tensor bytes + 1 KiB",
                    "measured": f"+{codec['bytes'] - codec['raw_float32_bytes']} bytes",
                    "met": codec["bytes"] - codec["raw_float32_bytes"] <= 1024})
    add("decode step overhead (round trip - server compute) <= 1 ms",
        _find(rows, "overhead", "splitlearn decode step"), "value", "<=", 1.0, "{:.2f} ms")
    most = max(cfg["concurrency"])  # the issue: 8 clients >= 4x; in general N clients >= N/2 x
    conc = [r for r in rows if r["workload"] == "concurrency" and r["clients"] == most and r.get("batching")]
    if conc:
        best = max(conc, key=lambda r: r["ratio"])
        out.append({"target": f"{most} concurrent clients >= {most / 2:g}x one client's aggregate tokens/s",
                    "measured": f"{best['ratio']:.2f}x ({best['system']})", "met": best["ratio"] >= most / 2})
    for poll in ("", " poll-idle"):
        flag = " (--poll-idle)" if poll else ""
        for b, limit in ((min(cfg["gen_batches"]), 0.95), (max(cfg["gen_batches"]), 1.3)):
            add(f"pinned two devices{flag}, generation batch {b}, U-shape float32: tokens/s >= {limit}x "
                f"unsplit on one core", _find(rows, "pinned", "splitlearn u float32" + poll, batch=b), "ratio",
                ">=", limit, "{:.3f}x")
        add(f"pinned two devices{flag}, decode step overhead (round trip - server compute) <= 1 ms",
            _find(rows, "pinned", "splitlearn decode step" + poll), "value", "<=", 1.0, "{:.2f} ms")
    most = max(cfg.get("server_batching_clients") or [0])
    sb = [r for r in rows if r["workload"] == "server_batching" and r["clients"] == most and r.get("batching")]
    if sb:
        best = max(sb, key=lambda r: r["ratio"])
        out.append({"target": f"server batching: {most} replayed sessions >= {most / 2:g}x one session's "
                              f"decode tokens/s", "measured": f"{best['ratio']:.2f}x ({best['system']})",
                    "met": best["ratio"] >= most / 2})
    for base in ("naive JSON", "torch.distributed.rpc"):
        losses = []
        for r in rows:
            if r["system"] != base or r["workload"] not in ("generation", "training", "overhead"):
                continue
            ours = _best_splitlearn(rows, r)
            if ours is None:
                continue
            ahead = ours["value"] > r["value"] if r["better"] == "higher" else ours["value"] < r["value"]
            if not ahead:
                losses.append(r["case"])
        if any(r["system"].startswith(base) for r in rows):
            out.append({"target": f"splitlearn ahead of {base} on every workload",
                        "measured": "ahead everywhere" if not losses else "behind on " + "; ".join(losses),
                        "met": not losses})
    return out


def _best_splitlearn(rows, r) -> Optional[dict]:
    """splitlearn's U-shape float32 row comparable with baseline row ``r``."""
    if r["workload"] == "overhead":
        return _find(rows, "overhead", "splitlearn health")
    return _find(rows, r["workload"], "splitlearn u float32", **({"batch": r["batch"]} if "batch" in r else {}))


def _fmt(v, unit=""):
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown(result: dict) -> str:
    rows = result["rows"]
    m = result["machine"]
    lines = [f"# splitlearn benchmarks: {result['device']}", "",
             f"Command: `{result['command']}` ({result['seconds']:.0f} s, {result['started']}).  ",
             f"Machine: {m.get('gpu') or m['processor']}, {m['cpu_count']} cores, torch {m['torch']} "
             f"({m['torch_threads']} threads per process), transformers {m.get('transformers')}, "
             f"Python {m['python']}; model `{result['config']['model']}`, U-shape cuts "
             f"{tuple(result['config']['u_cuts'])}, 2-way cut {result['config']['two_way_cut']}. "
             f"Medians of {result['config']['repeats']} runs after {result['config']['warmup']} warm-up.", ""]
    tg = targets(result)
    if tg:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |" for t in tg]
        lines.append("")
    sections = [("generation", "Generation (greedy)", ["tokens/s", "ratio", "same_tokens", "overhead_ms_per_call",
                                                        "server_ms_per_call", "bytes_per_call"]),
                ("training", "Training step", ["s/step", "ratio", "overhead_ms_per_call", "bytes_per_step"]),
                ("codec", "Wire codec", ["GB/s", "bytes", "header_bytes", "max_abs_error"]),
                ("overhead", "Per-request overhead", ["ms/call", "round_trip_ms", "server_ms"]),
                ("int8_drift", "Loss drift of lossy wire dtypes", ["max |diff|", "mean_abs_diff", "final_loss",
                                                                  "final_loss_float32"]),
                ("concurrency", "Concurrent generation clients", ["tokens/s (all clients)", "ratio", "median_s"]),
                ("pinned", "Two devices emulated: client and server on cores of their own, one thread each",
                 ["tokens/s", "ms/call", "ratio", "same_tokens", "round_trip_ms", "server_ms"]),
                ("server_batching", "Server batching alone: replayed activations, no client compute",
                 ["server decode tokens/s", "ratio", "ms_per_round"])]
    for workload, title, cols in sections:
        sub = [r for r in rows if r["workload"] == workload]
        if not sub:
            continue
        lines += [f"## {title}", ""]
        header = ["case", "system"] + cols
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in sub:
            cells = [r["case"], r["system"]]
            for c in cols:
                cells.append(_fmt(r["value"]) if c in (r["unit"], "max |diff|") else _fmt(r.get(c, "")))
            lines.append("| " + " | ".join(cells) + " |")
        notes = sorted({r["note"] for r in sub if r.get("note")})
        lines += [""] + [f"Note: {n}." for n in notes] + ([""] if notes else [])
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a [bench] dependency
        return None
    rows = result["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    gen = [r for r in rows if r["workload"] == "generation"]
    ax = axes[0][0]
    systems = list(dict.fromkeys(r["system"] for r in gen))
    batches = list(dict.fromkeys(r["batch"] for r in gen))
    width = 0.8 / max(1, len(batches))
    for i, b in enumerate(batches):
        vals = [next((r["ratio"] for r in gen if r["system"] == s and r["batch"] == b), 0) for s in systems]
        ax.barh([j + i * width for j in range(len(systems))], vals, height=width, label=f"batch {b}")
    ax.set_yticks([j + width * (len(batches) - 1) / 2 for j in range(len(systems))], systems, fontsize=7)
    ax.axvline(0.95, color="k", ls="--", lw=0.8)
    ax.set_xlabel("tokens/s relative to the unsplit model (higher is better)")
    ax.set_title("Generation")
    ax.legend(fontsize=7)
    tr = [r for r in rows if r["workload"] == "training"]
    _bars(axes[0][1], tr, "ratio", 1.05, "step time relative to the unsplit model (lower is better; log)",
          "Training step")
    conc = [r for r in rows if r["workload"] == "concurrency"]
    ax = axes[1][0]
    for s in dict.fromkeys(r["system"] for r in conc):
        pts = [(r["clients"], r["value"]) for r in conc if r["system"] == s]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
    ax.set_xlabel("simultaneous clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Concurrent generation")
    if conc:
        ax.legend(fontsize=7)
    codec = [r for r in rows if r["workload"] == "codec"]
    _bars(axes[1][1], codec, "value", 5.0, "encode + decode GB/s of the float32 tensor (log)", "Wire codec")
    fig.suptitle(f"splitlearn benchmarks, {result['device']}: {result['config']['model']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, rows: list[dict], key: str, target: float, xlabel: str, title: str) -> None:
    """One horizontal bar per row (log scale), with the target as a dashed line."""
    ax.barh(range(len(rows)), [r[key] for r in rows])
    ax.set_yticks(range(len(rows)), [r["system"] for r in rows], fontsize=7)
    ax.axvline(target, color="k", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)


def write(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    paths[0].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(result))
    png = plot(result, out_dir / "summary.png")
    return paths + ([png] if png else [])
