"""The report of :func:`splitlearn.analysis.analyze` as a terminal table, JSON, CSV and Markdown."""
from __future__ import annotations

import csv
import io
import json

from ..api.wire import WIRE_DTYPE_NAMES

CSV_FIELDS = ("segment", "name", "parent", "blocks", "params", "macs", "flops",
              "latency_median_ms", "latency_p90_ms", "peak_memory_bytes", "output_bytes")


def _verdict(c: dict) -> str:
    """A sum check's word: ok; noisy (beyond 10% but within the runs' own spread: a busy machine,
    measure again); OFF (beyond both)."""
    if c["ok"]:
        return "ok"
    if c.get("verdict") == "noisy":
        return (f"noisy: off by {abs(c['ratio'] - 1):.0%}, within the runs' spread of {c['spread']:.0%}; "
                f"measure again on an idle machine or with more --repeats")
    return "OFF by more than 10%" + (f" and the runs' spread of {c['spread']:.0%}" if c.get("spread") else "")


def _m(n: float) -> str:
    return f"{n / 1e6:.2f}M"


def _g(n: float) -> str:
    return f"{n / 1e9:.4f}"


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f}"


def _ms(latency, key: str, fmt: str = ".3f") -> str:
    """A latency figure, or "-" where nothing was timed (the meta device)."""
    return "-" if latency is None else format(latency[key], fmt)


def _csv_ms(latency, key: str):
    return "" if latency is None else round(latency[key], 4)


def _peak(n) -> str:
    return "-" if n is None else _mib(n)


def rows(report: dict) -> list[dict]:
    """One flat row per segment and per submodule (the CSV's rows)."""
    out = []
    for seg in report["segments"]:
        for sub in [dict(seg, name="(segment)", parent="")] + seg["submodules"]:
            out.append({"segment": seg["name"], "name": sub["name"], "parent": sub.get("parent", ""),
                        "blocks": f"[{seg['blocks'][0]},{seg['blocks'][1]})",
                        "params": sub["params"], "macs": sub["macs"], "flops": sub["flops"],
                        "latency_median_ms": _csv_ms(sub["latency_ms"], "median"),
                        "latency_p90_ms": _csv_ms(sub["latency_ms"], "p90"),
                        "peak_memory_bytes": sub["peak_memory_bytes"],
                        "output_bytes": sub["output_bytes"]})
    return out


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, default=str)


def to_csv(report: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    w.writerows(rows(report))
    return buf.getvalue()


def _table(header: list[str], body: list[list], markdown: bool) -> list[str]:
    cells = [[str(c) for c in r] for r in [header] + body]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(r) + " |" for r in cells[1:]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]]


def segment_lines(report: dict, markdown: bool = False) -> list[str]:
    """Segments, then each segment's submodules, then cuts, tied weights and checks."""
    cfg = report["config"]
    lines = []
    h = ["", "blocks", "params", "GMACs", "GFLOPs", "median ms", "p90 ms", "peak MiB", "out KiB"]
    body = [[s["name"], f"[{s['blocks'][0]}, {s['blocks'][1]})", _m(s["params"]), _g(s["macs"]),
             _g(s["flops"]), _ms(s["latency_ms"], "median"), _ms(s["latency_ms"], "p90"),
             _peak(s["peak_memory_bytes"]), f"{s['output_bytes'] / 1024:.1f}"]
            for s in report["segments"]]
    lines += [f"Segments ({cfg['mode']}, batch {cfg['batch_size']}, sequence {cfg['seq_len']}, "
              f"{report['model']['dtype']} on {report['device']['type']}):", ""]
    lines += _table(h, body, markdown) + [""]
    for s in report["segments"]:
        lines.append(f"{s['name']} submodules (share = of the segment's median latency):")
        lines.append("")
        seg_ms = (s["latency_ms"] or {}).get("median") or 1
        body = [[("  " if sub["parent"] else "") + sub["name"], _m(sub["params"]), _g(sub["macs"]),
                 _ms(sub["latency_ms"], "median"), _ms(sub["latency_ms"], "p90"),
                 "-" if sub["latency_ms"] is None else f"{100 * sub['latency_ms']['median'] / seg_ms:.1f}%"]
                for sub in s["submodules"]]
        lines += _table(["submodule", "params", "GMACs", "median ms", "p90 ms", "share"], body, markdown)
        for c in s["latency_sum_checks"]:
            lines.append(f"{'' if not markdown else '- '}sum check {c['parent'] or s['name']}: "
                         f"parts {c['children_ms']:.3f} ms / whole {c['parent_ms']:.3f} ms = "
                         f"{c['ratio']:.2f} ({_verdict(c)})")
        mm = s["mac_crosscheck"]["mismatches"]
        fc = s["mac_crosscheck"]["flop_counter"]
        lines.append(f"{'' if not markdown else '- '}MACs: fvcore {s['macs']}, flop_counter "
                     f"{'- (not run on meta)' if fc is None else fc}, analytic {s['mac_crosscheck']['analytic']}"
                     f"; {len(mm)} mismatch(es) above 1%")
        for m in mm:
            lines.append(f"  MISMATCH {m['module'] or '(segment)'}: fvcore {m['fvcore']} vs "
                         f"{m['reference']} {m['other']} ({100 * m['relative']:.1f}%)")
        lines.append(f"{'' if not markdown else '- '}KV cache held: {s['kv_cache_bytes']} bytes")
        lines.append("")
    lines += cut_lines(report, markdown) + tied_lines(report) + operator_lines(report, markdown)
    return lines


def cut_lines(report: dict, markdown: bool) -> list[str]:
    body = []
    for c in report["cuts"]:
        for direction in ("activations", "gradients"):
            b = c.get(f"{direction}_bytes")
            if b:
                body.append([f"after block {c['block']} ({c['from']} -> {c['to']})", direction]
                            + [b[k] for k in WIRE_DTYPE_NAMES])
    return (["Bytes crossing each cut per step:", ""]
            + _table(["cut", "what", *WIRE_DTYPE_NAMES], body, markdown) + [""])


def tied_lines(report: dict) -> list[str]:
    out = []
    for t in report["tied_parameters"]:
        names = " and ".join(f"{h['segment']}.{h['parameter']}" for h in t["holders"])
        out.append(f"Tied weights: {names} are one tensor of {_m(t['params'])} parameters; "
                   f"each segment that holds it counts it (a separate process needs its own copy).")
    return out + ([""] if out else [])


def operator_lines(report: dict, markdown: bool, top: int = 8) -> list[str]:
    roof = report.get("roofline")
    if not roof:
        return []
    lines = [f"Operators (ridge point {roof['ridge_flops_per_byte']:.1f} FLOP/byte = "
             f"{roof['tflops']:.3f} TFLOP/s / {roof['mem_bw_gbs']:.1f} GB/s, "
             f"{'measured' if roof['measured'] else 'given'}):", ""]
    for s in report["segments"]:
        body = [[s["name"], o["op"], o["calls"], f"{o['flops'] / 1e6:.2f}", f"{o['bytes'] / 2 ** 20:.2f}",
                 f"{o['intensity']:.2f}", o["bound"]] for o in s.get("operators", [])[:top]]
        lines += _table(["segment", "op", "calls", "MFLOPs", "MiB moved", "FLOP/byte", "bound"],
                        body, markdown) + [""]
    return lines


def sweep_lines(sw: dict, markdown: bool = False) -> list[str]:
    wire = sw["link"]["wire_dtype"]
    h = ["cut", "client GMACs", "server GMACs", "client ms", "server ms", f"bytes ({wire})"]
    has_step = "step_ms" in sw["points"][0]
    if has_step:
        h += ["transfer ms", "step ms"]
    body = []
    for p in sw["points"]:
        r = [p["cut"], _g(p["client_macs"]), _g(p["server_macs"]), _ms(p, "client_ms", ".2f") if "client_ms" in p
             else "-", _ms(p, "server_ms", ".2f") if "server_ms" in p else "-", p["bytes"][wire]]
        if has_step:
            r += [f"{p['transfer_ms']:.2f}", f"{p['step_ms']:.2f}"]
        body.append(r)
    lines = [f"Sweep over every 2-way cut ({sw['mode']}):", ""] + _table(h, body, markdown) + [""]
    if "recommendation" in sw:
        lines += [f"Recommended: {sw['recommendation']['reason']}", ""]
    return lines


def to_text(report: dict) -> str:
    lines = segment_lines(report) if report.get("segments") else []
    if report.get("sweep"):
        lines += sweep_lines(report["sweep"])
    return "\n".join(lines)


def to_markdown(report: dict, title: str = "splitlearn model analysis") -> str:
    cfg = report["config"]
    dev = report["device"]
    lines = [f"# {title}", "",
             f"Model `{cfg['model']}` ({report['model']['params'] / 1e6:.2f}M parameters), cuts "
             f"{cfg['cuts']}, mode {cfg['mode']}, batch {cfg['batch_size']}, sequence {cfg['seq_len']}, "
             f"{cfg['repeats']} timed runs after {cfg['warmup']} warm-up; device: {dev['type']} "
             f"{dev.get('name', '')} ({dev.get('cores', '?')} cores)." if dev["type"] == "cpu" else
             f"Model `{cfg['model']}`, cuts {cfg['cuts']}, mode {cfg['mode']}, device {dev['name']}.",
             "", "MACs are multiply-accumulates of matrix products (1 MAC = 2 FLOPs); G = 10^9.", ""]
    if report.get("segments"):
        lines += segment_lines(report, markdown=True)
    if report.get("sweep"):
        lines += sweep_lines(report["sweep"], markdown=True)
    return "\n".join(lines) + "\n"
