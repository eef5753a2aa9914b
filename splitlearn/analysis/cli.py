"""``analyze_model_performance``: the command line (also ``analysis/analyze_model_performance.py``).

Examples: docs/ANALYSIS.md. Bad input prints one line on stderr and exits with status 2."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..procs.clihelp import DefaultsHelpFormatter
from ..errors import SplitLearnError

# torch and the analysis modules are imported by the functions that use them, so that --help
# answers at once
WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")  # splitlearn.api.wire.WIRE_DTYPE_NAMES (a test keeps them equal)

log = logging.getLogger(__name__)
PROG = "analyze_model_performance"


def build_report(config: "AnalysisConfig", link: Optional["LinkConfig"] = None,
                 do_sweep: bool = False, model: Optional["torch.nn.Module"] = None,
                 privacy: Optional["PrivacyConfig"] = None) -> dict:
    """The data the command writes as JSON: :func:`~.core.analyze`'s report for ``config.cuts`` (if
    any), with ``do_sweep`` a "sweep" entry, with ``privacy`` leakage and perplexity per cut."""
    from .core import analyze_partition, prepare_model
    from .leakage import Meter, annotate_sweep
    from .sweep import LinkConfig, sweep_cuts

    model, part, device = prepare_model(config, model)
    if part is not None:
        out = analyze_partition(model, part, device, config)
    else:
        from .core import device_info, model_info
        out = {"config": {**vars(config), "cuts": []},
               "model": model_info(model),
               "device": device_info(device), "roofline": None, "segments": [], "cuts": [],
               "tied_parameters": []}
    if do_sweep:
        out["sweep"] = sweep_cuts(model, config, link or LinkConfig(), device)
    if privacy is not None:
        meter = Meter(model, privacy)
        if config.cuts:
            out["privacy"] = meter.rows(tuple(config.cuts))
        if do_sweep:
            annotate_sweep(out["sweep"], model, privacy, meter)
    return out


def measured_link(source: str) -> dict:
    """A diagnose report: read from a JSON file, or measured now against a server URL."""
    import json

    if source.startswith(("http://", "https://", "unix://")):  # unix://: a --listen socket (docs/TRANSPORT.md)
        import os

        from .diagnose import DiagnoseConfig, diagnose
        from ..transport import Transport, TransportConfig

        log.info("measuring the link to %s", source)
        t = Transport(TransportConfig(source, os.environ.get("SPLITLEARN_TOKEN"), retries=1, connect_timeout_s=5.0))
        try:
            return diagnose(t, DiagnoseConfig(sizes=(1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20), repeats=3))
        finally:
            t.close()
    try:
        return json.loads(Path(source).read_text())
    except (OSError, ValueError) as e:
        raise SplitLearnError(f"--link-from {source}: cannot read a diagnose report ({e})") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, formatter_class=DefaultsHelpFormatter, description="What each segment of a split decoder-only model "
                                "(GPT-2, Llama, Gemma, ... docs/MODELS.md) costs (params, MACs/FLOPs, latency, memory, "
                                "bytes per cut), and where to cut.")
    p.add_argument("--model", default="tiny", help="hub id, directory, JSON config or spec name "
                   "(tiny, random:gpt2, llama2-7b-shape, ...); default tiny")
    p.add_argument("--cut", type=int, action="append", dest="cuts", metavar="C",
                   help="cut after block C; give twice for a U-shape (bottom, trunk, top)")
    p.add_argument("--batch-size", type=int, default=1, help="rows")
    p.add_argument("--seq-len", type=int, default=6, help="tokens (the KV length in decode)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, auto, or meta: shapes only, no weights "
                   "allocated (params, MACs/FLOPs, bytes; nothing timed): a 7B model's table in seconds")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="compute dtype")
    p.add_argument("--mode", default="prefill", choices=("prefill", "decode", "train"), help="what is timed")
    p.add_argument("--repeats", type=int, default=20, help="timed runs (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="timing budget per segment in seconds; at least 3 runs (default 10)")
    p.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s (default: measured)")
    p.add_argument("--mem-bw-gbs", type=float, help="device memory bandwidth GB/s (default: measured)")
    p.add_argument("--no-roofline", action="store_true", help="skip the per-operator breakdown")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and inputs")
    p.add_argument("--threads", type=int, help="torch CPU threads (torch.set_num_threads); on a "
                   "CPU shared with other work, 1 avoids stalls where a thread waits for a core")
    p.add_argument("--sweep", action="store_true", help="analyse every 2-way cut and plot compute "
                   "per side against bytes crossing")
    p.add_argument("--link-mbps", type=float, help="link bandwidth in Mbit/s (sweep step estimate)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time in ms (default 0)")
    p.add_argument("--link-from", metavar="FILE|URL",
                   help="with --sweep: the link measured by `python -m splitlearn.client diagnose --json` "
                        "(its JSON file), or measure it now against this server URL ($SPLITLEARN_TOKEN); "
                        "replaces --link-mbps and --rtt-ms")
    p.add_argument("--server-speedup", type=float, default=1.0,
                   help="how many times faster the server computes than this machine")
    p.add_argument("--wire-dtype", default="float32", choices=WIRE_DTYPES, help="dtype of the bytes per cut")
    p.add_argument("--min-client-blocks", type=int, default=1,
                   help="blocks the client keeps at least, for privacy (default 1)")
    p.add_argument("--privacy", action="store_true", help="measure token recovery by the best "
                   "inversion attack and perplexity per cut (and per sweep point)")
    p.add_argument("--max-leakage", type=float, help="with --sweep --privacy: recommend the "
                   "cheapest cut (2-way or U-shape) and defense whose token recovery is at most this")
    p.add_argument("--noise-sigma", type=float, action="append", default=[], metavar="S",
                   help="also measure GaussianNoise(S, clip); repeatable")
    p.add_argument("--noise-clip", type=float, help="per-token L2 clip (default: median norm)")
    p.add_argument("--privacy-seq-len", type=int, default=32, help="tokens per meter window")
    p.add_argument("--privacy-attacks", default="linear,mlp,gru,whitebox", help="the meter's attacks, comma-separated")
    p.add_argument("--privacy-epochs", type=int, default=30, help="inverter training epochs")
    p.add_argument("--privacy-max-tokens", type=int, help="private tokens to recover at most")
    p.add_argument("--privacy-rows", metavar="FILE.json", action="append", default=[],
                   help="with --privacy: rows measured by `python -m splitlearn.privacy --json` (e.g. "
                   "defenses fine-tuned in) used at the cuts they cover instead of measuring there; the "
                   "planner chooses among them; repeatable")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--csv", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png", help="segment plot; the sweep's goes to "
                   "FILE_sweep.png (or FILE when there are no cuts)")
    p.add_argument("--quiet", action="store_true", help="no table on stdout")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    import torch

    from .core import AnalysisConfig
    from .leakage import PrivacyConfig, load_rows
    from .sweep import LinkConfig

    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise SplitLearnError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        if not args.cuts and not args.sweep:
            raise SplitLearnError("give --cut C (twice for a U-shape) and/or --sweep")
        config = AnalysisConfig(
            model=args.model, cuts=tuple(args.cuts or ()), batch_size=args.batch_size,
            seq_len=args.seq_len, device=args.device, dtype=args.dtype, mode=args.mode,
            repeats=args.repeats, warmup=args.warmup, max_seconds=args.max_seconds,
            peak_tflops=args.peak_tflops,
            mem_bw_gbs=args.mem_bw_gbs, roofline=not args.no_roofline, seed=args.seed)
        common = dict(server_speedup=args.server_speedup, wire_dtype=args.wire_dtype,
                      min_client_blocks=args.min_client_blocks)
        if args.link_from:
            if not args.sweep:
                raise SplitLearnError("--link-from needs --sweep (the sweep is what uses the link)")
            if args.link_mbps is not None or args.rtt_ms:
                raise SplitLearnError("--link-from replaces --link-mbps and --rtt-ms: give one or the other")
            link = LinkConfig.from_diagnose(measured_link(args.link_from), **common)
        else:
            link = LinkConfig(link_mbps=args.link_mbps, rtt_ms=args.rtt_ms, **common)
        privacy = None
        if args.max_leakage is not None and not (args.privacy and args.sweep):
            raise SplitLearnError("--max-leakage needs --sweep and --privacy")
        if args.privacy_rows and not args.privacy:
            raise SplitLearnError("--privacy-rows needs --privacy")
        if args.privacy:
            privacy = PrivacyConfig(
                sigmas=tuple(args.noise_sigma), clip=args.noise_clip, max_leakage=args.max_leakage,
                seq_len=args.privacy_seq_len, attacks=tuple(args.privacy_attacks.split(",")),
                epochs=args.privacy_epochs, max_private_tokens=args.privacy_max_tokens,
                seed=args.seed, rows=load_rows(args.privacy_rows, args.model) if args.privacy_rows else ())
        data = build_report(config, link, args.sweep, privacy=privacy)
    except (SplitLearnError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    write_outputs(data, args)
    return 0


def write_outputs(data: dict, args: argparse.Namespace) -> None:
    from . import plots, report

    if not args.quiet:
        print(report.to_text(data))
        print(privacy_text(data), end="")
    for path, render in ((args.json, report.to_json), (args.csv, report.to_csv),
                         (args.markdown, report.to_markdown)):
        if path:
            Path(path).write_text(render(data))
    if args.plot:
        plot = Path(args.plot)
        if data["segments"]:
            plots.plot_segments(data, plot)
        if data.get("sweep"):
            target = plot.with_name(plot.stem + "_sweep" + plot.suffix) if data["segments"] else plot
            plots.plot_sweep(data["sweep"], target)
        rows = privacy_rows(data)
        if rows:
            from ..privacy.plots import plot_privacy
            plot_privacy(rows, plot.with_name(plot.stem + "_privacy" + plot.suffix))


def privacy_rows(data: dict) -> list[dict]:
    """Every distinct meter row of the report (analysed cuts, then sweep points)."""
    rows = list(data.get("privacy") or [])
    sweep = data.get("sweep") or {}
    for p in sweep.get("points", []) + sweep.get("u_points", []):
        for s in p.get("privacy", []):
            rows.append({"cut": p.get("cuts", [p.get("cut")]), **s})
    seen, out = set(), []
    for r in rows:
        key = (tuple(r["cut"]), str(r["defense"]))
        if key not in seen and (len(r["cut"]) == 1 or r["cut"][1] == r["cut"][0] + 1
                                or r.get("source") == "file"):
            seen.add(key)  # U-shapes: one per first cut (same activations cross); given rows: all
            out.append(r)
    return out


def privacy_text(data: dict) -> str:
    """Leakage lines for the text output ("" without --privacy)."""
    from .leakage import describe_defense

    lines = []
    for r in data.get("privacy") or []:
        dtext = describe_defense(r["defense"], r.get("finetune_steps") or 0)
        lines.append(f"Privacy cut {r['cut']} {dtext}: token recovery {r['token_recovery']:.3f} "
                     f"({r['best_attack']}), perplexity {r['perplexity']:.2f} (unsplit "
                     f"{r.get('perplexity_unsplit', r.get('perplexity_undefended')) or float('nan'):.2f})"
                     + (", labels reach the server" if r.get("labels_reach_server") else ""))
    sweep = data.get("sweep") or {}
    for p in sweep.get("points", []) if "privacy" in (sweep.get("points") or [{}])[0] else []:
        best = min(p["privacy"], key=lambda s: s["leakage"])
        lines.append(f"Sweep cut {p['cut']}: leakage {p['privacy'][0]['leakage']:.3f} undefended, "
                     f"{best['leakage']:.3f} at best")
    rec = sweep.get("private_recommendation")
    if rec:
        lines.append(f"Recommended under max leakage: {rec['reason']}")
    return "".join(line + "\n" for line in lines)


if __name__ == "__main__":
    sys.exit(main())
