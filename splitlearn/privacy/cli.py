"""``python -m splitlearn.privacy``: the leakage table of docs/PRIVACY.md, per cut and defense
strength (commands there, 'Reproduce, or measure your own checkpoint').

Every cut is measured without a defense and with ``GaussianNoise(sigma, clip)`` per ``--sigma``;
``--clip`` defaults to the median per-token norm at the cut. Bad input: one line on stderr, exit 2."""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import SplitLearnError
from ..loading import is_spec_source, load_model
from .attacks import ATTACKS, AttackConfig
from .defenses import GaussianNoise
from .meter import measure_leakage, median_token_norm
from .reference import reference_info, train_reference

log = logging.getLogger(__name__)
PROG = "python -m splitlearn.privacy"


def parse_cut(s: str) -> tuple[int, ...]:
    """``"3"`` -> (3,), ``"1,5"`` -> (1, 5)."""
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cut is C or C1,C2, got {s!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description="How many private "
                                "tokens the server reads back at each cut, with and without noise.")
    p.add_argument("--model", default="tiny-demo", help="spec, directory or hub id (default tiny-demo)")
    p.add_argument("--train-steps", type=int, default=0, help="first train the spec on the public "
                   "corpus for this many steps (cached; default 0: measure as loaded)")
    p.add_argument("--cut", type=parse_cut, action="append", dest="cuts", metavar="C[,C2]",
                   help="a 2-way cut C or a U-shape C1,C2; repeatable")
    p.add_argument("--sigma", type=float, action="append", default=[], help="GaussianNoise "
                   "noise multiplier; repeatable (a row without a defense is always measured)")
    p.add_argument("--clip", type=float, help="per-token L2 clip (default: median norm at the cut)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma list of {', '.join(ATTACKS)}")
    p.add_argument("--epochs", type=int, default=30, help="learned inverters' epochs")
    p.add_argument("--max-private-tokens", type=int, help="recover at most this many tokens")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict:
    """Measure every (cut, defense) of ``args``; returns {"model", "rows", "seconds", ...}."""
    t0 = time.perf_counter()
    if args.threads is not None:
        if args.threads < 1:
            raise SplitLearnError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if not args.cuts:
        raise SplitLearnError("give at least one --cut")
    source, trained = args.model, None
    if args.train_steps:
        if not is_spec_source(args.model):
            raise SplitLearnError("--train-steps trains a spec (tiny, tiny-demo, ...); "
                                  f"{args.model!r} is a checkpoint")
        source = str(train_reference(args.model, steps=args.train_steps, seed=args.seed))
        trained = reference_info(source)
    model = load_model(source, seed=args.seed, device=args.device)
    tokenizer = None
    if trained is not None:  # a directory without tokenizer files: bytes, like the spec
        from ..data import ByteTokenizer
        tokenizer = ByteTokenizer()
    config = AttackConfig(epochs=args.epochs, seed=args.seed)
    rows = []
    for cut in args.cuts:
        clip = args.clip
        if args.sigma and clip is None:
            clip = median_token_norm(model, cut, tokenizer=tokenizer, seq_len=args.seq_len)
        for sigma in [None] + list(args.sigma):
            defense = None if sigma is None else GaussianNoise(sigma=sigma, clip=clip)
            r = measure_leakage(model, cut, defense=defense, tokenizer=tokenizer,
                                attacks=tuple(args.attacks.split(",")), seq_len=args.seq_len,
                                delta=args.delta, config=config,
                                max_private_tokens=args.max_private_tokens, seed=args.seed)
            rows.append(r.as_dict())
            print(f"  cut {','.join(map(str, cut))} {_defense(rows[-1])}: recovery "
                  f"{r.token_recovery:.3f} ({r.best_attack}), perplexity {r.perplexity:.2f} "
                  f"(unsplit {r.perplexity_unsplit:.2f}), {r.seconds:.1f} s", file=sys.stderr)
    return {"model": args.model, "trained": trained, "device": args.device,
            "threads": torch.get_num_threads(), "rows": rows,
            "seconds": time.perf_counter() - t0}


def _defense(row: dict) -> str:
    d = row["defense"]
    return "none" if d["name"] == "none" else f"σ={d['sigma']:g}, C={d['clip']:.3g}"


def _eps(row: dict) -> str:
    e = row["epsilon"]
    return "—" if e is None else ("∞" if e == "inf" or math.isinf(e) else f"{e:.3g}")


def to_markdown(data: dict) -> str:
    """The table of docs/PRIVACY.md."""
    attacks = [a for a in ATTACKS if any(a in r["attacks"] for r in data["rows"])]
    head = (["cut", "defense", f"ε (δ={data['rows'][0]['delta'] or 1e-5:g}, per window)"]
            + attacks + ["best", "perplexity", "unsplit", "labels to server", "s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        cut = ",".join(map(str, r["cut"]))
        cells = ([cut if len(r["cut"]) == 1 else f"U {cut}", _defense(r), _eps(r)]
                 + [f"{r['attacks'][a]:.3f}" if a in r["attacks"] else "" for a in attacks]
                 + [f"**{r['token_recovery']:.3f}** ({r['best_attack']})", f"{r['perplexity']:.2f}",
                    f"{r['perplexity_unsplit']:.2f}", "yes" if r["labels_reach_server"] else "no",
                    f"{r['seconds']:.0f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        data = run(args)
    except (SplitLearnError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    table = to_markdown(data)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.plot:
        from .plots import plot_privacy
        plot_privacy(data["rows"], args.plot, title=f"{args.model}: token recovery vs perplexity")
    return 0


if __name__ == "__main__":
    sys.exit(main())
