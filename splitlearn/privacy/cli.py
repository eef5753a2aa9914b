"""``python -m splitlearn.privacy``: the leakage table of docs/PRIVACY.md, per cut and defense
strength (commands there, 'Reproduce, or measure your own checkpoint').

Every cut is measured without a defense, with ``GaussianNoise(sigma, clip)`` per ``--sigma`` and with
each ``--defense NAME[:FIELD=V,...]`` (``recommended``: :func:`~.presets.recommended`); ``--clip``
defaults to the median per-token norm at the cut (and the U-shape ``recommended`` preset's gradient
clip to the median per-token norm of the gradient sent back at the second cut:
:func:`~.meter.median_token_grad_norm`). With ``--defense-train-steps N`` every defended
row is measured on the model fine-tuned N steps *with* its defense, over the split
(:func:`splitlearn.apps.defensetrain.finetune_defense`, cached), the attackers trained on that model's
activations. With ``--speculative-attack`` every row also attacks the positions an assisted
(speculative) generation over the split releases, rejected drafts included (:mod:`.speculative`;
the generation runs in :func:`splitlearn.apps.defensetrain.speculative_releases`). Bad input: one line
on stderr, exit 2.

``python -m splitlearn.privacy`` runs :func:`main` with the fine-tuning (``splitlearn.apps.defensetrain``,
which sits above this package); this module alone measures defenses at test time only."""
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
from ..model.loading import is_spec_source, load_model
from .attacks import ATTACKS, LEARNED, AttackConfig
from ..defense.defenses import GaussianNoise, parse_defense
from .meter import (default_tokenizer, measure_leakage, median_token_grad_norm, median_token_norm, perplexities,
                    private_windows)
from .presets import recommended
from .reference import finetune_info, reference_info, train_reference
from .spent import spent

log = logging.getLogger(__name__)
PROG = "python -m splitlearn.privacy"
KNOWS = ("finetuned", "public", "both")


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
                   "noise multiplier, inserted at test time (never fine-tuned); repeatable (a row "
                   "without a defense is always measured)")
    p.add_argument("--defense", action="append", default=[], dest="defenses", metavar="NAME[:FIELD=V,...]",
                   help="a defense row: gaussian:sigma=2, nopeek:weight=0.5, gaussian+nopeek:sigma=1,"
                   "weight=0.3, recommended (the documented preset); repeatable")
    p.add_argument("--defense-train-steps", type=int, metavar="N", help="fine-tune the model N steps "
                   "with each --defense, over the split, before measuring it (cached; default 0: "
                   "the defense at test time only; recommended: its preset's steps; --sigma rows "
                   "stay at test time)")
    p.add_argument("--defense-lr", type=float, default=1e-3, help="fine-tuning learning rate")
    p.add_argument("--defense-batch-size", type=int, default=16, help="fine-tuning sequences per step")
    p.add_argument("--defense-seq-len", type=int, default=64, help="fine-tuning tokens per sequence")
    p.add_argument("--attacker-knows", choices=KNOWS, default="finetuned",
                   help="the weights the attacker uses: finetuned (the client's own, fine-tuned where the "
                   "row is; pessimistic, the default), public (the reference model before the defense "
                   "fine-tuning: a client that fine-tuned its blocks in secret), both (a row each; rows "
                   "not fine-tuned are measured once, their weights being the public ones)")
    p.add_argument("--gradient-attacks", default="", metavar="KIND[,KIND]",
                   help="U-shape: learned inverters (linear, mlp, gru) on the gradient the client sends at "
                   "the second cut in training; the row's token_recovery_gradient (default: none)")
    p.add_argument("--speculative-attack", action="store_true",
                   help="also attack the speculative-decoding releases: greedy generation with assisted "
                   "decoding over the split from private prompts, every position the server receives "
                   "(drafts later rejected included) attacked; the row's speculative field")
    p.add_argument("--speculative-prompts", type=int, default=8, help="private prompts generated from (default 8)")
    p.add_argument("--speculative-new-tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    p.add_argument("--speculative-draft", choices=("free", "lookup"), help="the draft: free (the U-shape "
                   "client's own blocks, the U-shape default) or lookup (prompt lookup, the 2-way default)")
    p.add_argument("--speculative-draft-tokens", type=int, default=4, help="tokens drafted per round (default 4)")
    p.add_argument("--text", type=Path, metavar="FILE", help="your own text (UTF-8): its paragraphs (blank-line "
                   "separated; lines where it has fewer than 2) split into the attacker's public part and the "
                   "owner's private part, the last --private-share of them private (default: the shipped corpus)")
    p.add_argument("--private-share", type=float, default=0.2, help="with --text: the share of its paragraphs "
                   "that is private (default 0.2)")
    p.add_argument("--public-text", type=Path, metavar="FILE", help="the text the attacker has (its inverters "
                   "train on it; the clips' medians are taken on it); with --private-text, instead of --text")
    p.add_argument("--private-text", type=Path, metavar="FILE", help="the owner's text the attacker tries to "
                   "recover (and the perplexity is measured on)")
    p.add_argument("--clip", type=float, help="per-token L2 clip (default: median norm at the cut)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--attacks", default="", help=f"comma list of {', '.join(ATTACKS)} (default: every attack "
                   "the model's family has: all on GPT-2, the learned inverters on the others)")
    p.add_argument("--epochs", type=int, default=30, help="learned inverters' epochs")
    p.add_argument("--max-private-tokens", type=int, help="recover at most this many tokens")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _paragraphs(path: Path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SplitLearnError(f"cannot read {path}: {e}") from None
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    return paras if len(paras) >= 2 else [line.strip() for line in text.splitlines() if line.strip()]


def user_texts(args) -> tuple[Optional[list[str]], Optional[list[str]]]:
    """(public, private) paragraphs of ``--text`` or ``--public-text``/``--private-text``; (None,
    None) for the shipped corpus."""
    text, public, private = (getattr(args, n, None) for n in ("text", "public_text", "private_text"))
    if text is not None and (public is not None or private is not None):
        raise SplitLearnError("give --text, or --public-text with --private-text, not both")
    if (public is None) != (private is None):
        raise SplitLearnError("--public-text and --private-text go together (or give one --text to split)")
    if public is not None:
        pub, priv = _paragraphs(public), _paragraphs(private)
        if not pub or not priv:
            raise SplitLearnError(f"{public if not pub else private} holds no text")
        return pub, priv
    if text is None:
        return None, None
    share = args.private_share
    if not 0 < share < 1:
        raise SplitLearnError(f"--private-share is a share in (0, 1), got {share}")
    paras = _paragraphs(text)
    if len(paras) < 2:
        raise SplitLearnError(f"{text} has {len(paras)} paragraphs or lines: need 2 or more to split it into "
                              f"public and private text")
    n = min(max(1, round(len(paras) * share)), len(paras) - 1)
    return paras[:-n], paras[-n:]


def _defense_rows(args, cut, clip, grad_clip=None):
    """[(defense or None, fine-tuning steps, preset name or None)] of ``cut``: none, each --sigma,
    each --defense."""
    rows = [(None, 0, None)]
    steps = args.defense_train_steps
    for sigma in args.sigma:  # at test time, as before fine-tuning existed
        rows.append((GaussianNoise(sigma=sigma, clip=clip), 0, None))
    for spec in args.defenses:
        if spec == "recommended":
            preset = recommended("u" if len(cut) == 2 else "2-way", cut)
            rows.append((preset.defense(clip, grad_clip), preset.train_steps if steps is None else steps, spec))
        else:
            rows.append((parse_defense(spec, clip=clip), steps or 0, None))
    return rows


def _needs_clip(args) -> bool:
    return bool(args.sigma) or any(s == "recommended" or s.split(":")[0].startswith("gaussian")
                                   for s in args.defenses)


def run(args: argparse.Namespace, finetune=None, speculate=None) -> dict:
    """:func:`measure` with ``--no-progress`` reaching transformers' own bars too (its "Loading
    weights" bar on every checkpoint loaded), restored after."""
    from transformers.utils import logging as hf_logging

    quiet = getattr(args, "no_progress", False) and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        return measure(args, finetune, speculate)
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def measure(args: argparse.Namespace, finetune=None, speculate=None) -> dict:
    """Measure every (cut, defense) of ``args``; returns {"model", "rows", "seconds", ...}.
    ``finetune``: :func:`splitlearn.apps.defensetrain.finetune_defense` (needed for fine-tuned rows);
    ``speculate``: :func:`splitlearn.apps.defensetrain.speculative_releases` (``--speculative-attack``)."""
    t0 = time.perf_counter()
    steps = args.defense_train_steps
    if steps is not None and (isinstance(steps, bool) or steps < 0):
        raise SplitLearnError(f"--defense-train-steps must be >= 0, got {steps}")
    for spec in args.defenses:  # bad specs fail before anything is trained
        if spec != "recommended":
            parse_defense(spec, clip=1.0)
    knows = getattr(args, "attacker_knows", "finetuned")
    if knows not in KNOWS:
        raise SplitLearnError(f"--attacker-knows is one of {', '.join(KNOWS)}, got {knows!r}")
    grad_kinds = tuple(k for k in (getattr(args, "gradient_attacks", "") or "").split(",") if k)
    for k in grad_kinds:
        if k not in LEARNED:
            raise SplitLearnError(f"unknown gradient attack {k!r}; known: {', '.join(LEARNED)}")
    if args.threads is not None:
        if args.threads < 1:
            raise SplitLearnError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if not args.cuts:
        raise SplitLearnError("give at least one --cut")
    spec_attack = getattr(args, "speculative_attack", False)
    if spec_attack:
        if speculate is None:
            raise SplitLearnError("the speculative attack generates over the split through the model "
                                  "classes: use python -m splitlearn.privacy (splitlearn.apps.defensetrain)")
        for name in ("speculative_prompts", "speculative_new_tokens", "speculative_draft_tokens"):
            if getattr(args, name) < 1:
                raise SplitLearnError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if getattr(args, "speculative_draft", None) == "free" and any(len(c) != 2 for c in args.cuts):
            raise SplitLearnError("--speculative-draft free is the U-shape client's own blocks; a 2-way "
                                  "cut drafts by prompt lookup")
    public, private = user_texts(args)
    source, trained = args.model, None
    if args.train_steps:
        if not is_spec_source(args.model):
            raise SplitLearnError("--train-steps trains a spec (tiny, tiny-demo, ...); "
                                  f"{args.model!r} is a checkpoint")
        source = str(train_reference(args.model, steps=args.train_steps, seed=args.seed,
                                     progress=not args.no_progress))
        trained = reference_info(source)
    model = load_model(source, seed=args.seed, device=args.device)
    tokenizer = None
    if trained is not None:  # a directory without tokenizer files: bytes, like the spec
        from ..model.data import ByteTokenizer
        tokenizer = ByteTokenizer()
    config = AttackConfig(epochs=args.epochs, seed=args.seed)
    rows = []
    for cut in args.cuts:
        clip = args.clip
        if clip is None and _needs_clip(args):
            clip = median_token_norm(model, cut, texts=public, tokenizer=tokenizer, seq_len=args.seq_len)
        grad_clip = None  # the recommended U-shape preset's gradient clip follows the model too
        if len(cut) == 2 and "recommended" in args.defenses:
            grad_clip = median_token_grad_norm(model, cut, texts=public, tokenizer=tokenizer, seq_len=args.seq_len)
        plan = _defense_rows(args, cut, clip, grad_clip)
        if any(n for _, n, _ in plan):
            if finetune is None:
                raise SplitLearnError("defense-aware fine-tuning runs through the model classes: use "
                                      "python -m splitlearn.privacy (splitlearn.apps.defensetrain)")
            from ..model.data import is_bytes
            if not is_bytes(tokenizer or default_tokenizer(model, source)):
                raise SplitLearnError("defense-aware fine-tuning trains on the corpus as bytes: a model "
                                      "with its own tokenizer is measured with the defense at test time "
                                      "only (no --defense-train-steps)")
        undefended = None
        for defense, n, preset in plan:
            measured, info = model, None
            if n:
                path = finetune(source, cut, defense, n, batch_size=args.defense_batch_size,
                                seq_len=args.defense_seq_len, lr=args.defense_lr, seed=args.seed,
                                progress=not args.no_progress, **({} if public is None else {"texts": public}))
                measured, info = load_model(str(path), seed=args.seed, device=args.device), finetune_info(path)
            # the attacker's weights: the client's own, or the public reference (a secret client);
            # a row that was not fine-tuned has the public weights, measured once
            who = ("finetuned", "public") if knows == "both" else (knows,)
            if not n and knows == "both":
                who = ("finetuned",)
            for k in who:
                r = measure_leakage(measured, cut, defense=defense, tokenizer=tokenizer, texts=private,
                                    public_texts=public,
                                    attacks=tuple(a for a in args.attacks.split(",") if a) or None,
                                    seq_len=args.seq_len,
                                    delta=args.delta, config=config,
                                    max_private_tokens=args.max_private_tokens, seed=args.seed,
                                    attacker_model=model if k == "public" else None,
                                    gradient_attacks=grad_kinds if len(cut) == 2 else ())
                if undefended is None:
                    undefended = r.perplexity
                r.perplexity_undefended = undefended
                if defense is not None:
                    ids = private_windows(tokenizer or default_tokenizer(model, source), private,
                                          seq_len=args.seq_len, max_private_tokens=args.max_private_tokens)
                    r.perplexity_test_time = perplexities(model, cut, ids, defense, args.seed)[0]
                if info is not None:
                    _add_finetune(r, defense, info, args.delta)
                spec = None
                if spec_attack:
                    spec = _speculative(args, speculate, str(path) if n else source, model, measured, cut,
                                        defense, tokenizer, config, k, private)
                rows.append(dict(r.as_dict(), preset=preset, speculative=spec))
                grad = r.token_recovery_gradient
                print(f"  cut {','.join(map(str, cut))} {_defense(rows[-1])}"
                      f"{f' trained {n} steps' if n else ''}, attacker knows {r.attacker_knows}: recovery "
                      f"{r.token_recovery:.3f} ({r.best_attack})"
                      f"{'' if grad is None else f', from the gradient at cut 2 {grad:.3f}'}, perplexity "
                      f"{r.perplexity:.2f} (undefended {undefended:.2f}), {r.seconds:.1f} s", file=sys.stderr)
    for missing in add_controls(rows):
        print(f"  note: cut {missing[0]}: no undefended row fine-tuned {missing[1]} steps to compare the "
              f"fine-tuned rows with (add --defense none): their perplexity also reflects the extra "
              f"training", file=sys.stderr)
    return {"model": args.model, "trained": trained, "device": args.device,
            "text": {"public": str(getattr(args, "public_text", None) or getattr(args, "text", None) or "shipped corpus"),
                     "private": str(getattr(args, "private_text", None) or getattr(args, "text", None) or "shipped corpus"),
                     "public_paragraphs": None if public is None else len(public),
                     "private_paragraphs": None if private is None else len(private)},
            "threads": torch.get_num_threads(), "rows": rows,
            "seconds": time.perf_counter() - t0}


def _speculative(args, speculate, source, reference, measured, cut, defense, tokenizer, config, knows,
                 private=None) -> dict:
    """The row's ``speculative`` field: the releases of assisted generations over the split from the
    first ``--speculative-prompts`` private windows' first half (``seq_len // 2`` tokens, so that
    every position sent lies within the inverters' windows when prompt + new <= seq_len), attacked
    (:func:`~.speculative.attack_releases`)."""
    from .speculative import attack_releases

    tok = tokenizer or default_tokenizer(measured, source)
    prompts = private_windows(tok, private, seq_len=args.seq_len)[:args.speculative_prompts, :args.seq_len // 2]
    draft = args.speculative_draft or ("free" if len(cut) == 2 else "lookup")
    rel = speculate(source, cut, defense, prompts.tolist(), new_tokens=args.speculative_new_tokens,
                    draft=draft, draft_tokens=args.speculative_draft_tokens, seed=args.seed)
    out = attack_releases(measured, cut, defense, rel, tokenizer=tok, config=config, seq_len=args.seq_len,
                          delta=args.delta, attacker_model=reference if knows == "public" else None)
    print(f"  speculative ({draft} draft, {out['draft_tokens']} per round): {out['released']} positions "
          f"released for {out['prompt_tokens']} prompt + {out['new_tokens']} new tokens "
          f"({out['released_beyond_plain']} beyond plain decoding), recovery {out['token_recovery']:.3f} ({out['best_attack']}), of the "
          f"rejected drafts {out['token_recovery_rejected'] or 0:.3f}", file=sys.stderr)
    return out


def add_controls(rows: list) -> list:
    """Give every fine-tuned row its control: ``perplexity_control``, the perplexity of the
    undefended row of the same cut fine-tuned as many steps by the same command (the same text, lr,
    batch; attacker alike), so that a defended row is compared with a model trained as long, not
    only with the reference before the fine-tuning. Returns the (cut, steps) without one."""
    ctrl = {(tuple(r["cut"]), r.get("finetune_steps") or 0, r.get("attacker_knows")): r["perplexity"]
            for r in rows if r["defense"].get("name") == "none" and r.get("finetune_steps")}
    missing = []
    for r in rows:
        n = r.get("finetune_steps") or 0
        if not n:
            continue
        key = (tuple(r["cut"]), n, r.get("attacker_knows"))
        if key in ctrl:
            r["perplexity_control"] = ctrl[key]
        elif (key[0], n) not in missing:
            missing.append((key[0], n))
    return [(",".join(map(str, c)), n) for c, n in missing]


def _add_finetune(r, defense, info: dict, delta: float) -> None:
    """The fine-tuning's cost and epsilon on report ``r``. A token of the fine-tuning text lies in
    about ``windows_sent * seq_len / tokens`` of the random windows sent; each can release up to
    ``seq_len`` vectors that depend on it: that many releases (a mean; random windows)."""
    r.defense_trained = True
    r.finetune = info
    r.finetune_steps, r.finetune_seconds = info["steps"], info["seconds"]
    s = spent(defense, windows=info["windows_sent"], seq_len=info["seq_len"], tokens=info["tokens"], delta=delta)
    if s is not None:  # both channels composed where the gradient is defended too (:mod:`.spent`)
        r.releases_finetune, r.epsilon_finetune = s["releases_per_token"], s["epsilon"]


def _defense(row: dict) -> str:
    d = row["defense"]
    parts = []
    if "sigma" in d:
        parts.append(f"σ={d['sigma']:g}, C={d['clip']:.3g}")
    if "weight" in d:
        parts.append(f"NoPeek {d['weight']:g}")
    if d.get("residual"):
        parts.append("residual")
    if d.get("grad_clip") is not None:
        parts.append(f"gradient σ={d.get('grad_sigma', 0):g}, C={d['grad_clip']:.3g}")
    return ("recommended: " if row.get("preset") == "recommended" else "") + (", ".join(parts) or "none")


def _eps(row: dict) -> str:
    e = row["epsilon"]
    return "—" if e is None else ("∞" if e == "inf" or math.isinf(e) else f"{e:.3g}")


def to_markdown(data: dict) -> str:
    """The table of docs/PRIVACY.md."""
    attacks = [a for a in ATTACKS if any(a in r["attacks"] for r in data["rows"])]
    knows = any(r.get("attacker_knows", "finetuned") != "finetuned" for r in data["rows"])
    grads = any(r.get("token_recovery_gradient") is not None for r in data["rows"])
    specs = any(r.get("speculative") for r in data["rows"])
    mean_update = any(r.get("perplexity_mean_update") is not None for r in data["rows"])
    control = any(r.get("perplexity_control") is not None for r in data["rows"])
    head = (["cut", "defense", "fine-tuned"] + (["attacker knows"] if knows else [])
            + [f"ε (δ={data['rows'][0]['delta'] or 1e-5:g}, per window)"]
            + attacks + ["best"] + (["gradient at cut 2"] if grads else [])
            + (["speculative: released (beyond plain)", "speculative: recovered (rejected drafts)"] if specs else [])
            + ["perplexity", "× undefended"] + (["× undefended trained as long"] if control else [])
            + ["at test time", "without server"]
            + (["server's update averaged"] if mean_update else []) + ["labels to server", "s (fine-tune + meter)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        cut = ",".join(map(str, r["cut"]))
        undef = r.get("perplexity_undefended") or r["perplexity_unsplit"]
        test_time = r.get("perplexity_test_time")
        ft = r.get("finetune_steps") or 0
        g = r.get("token_recovery_gradient")
        kinds = r.get("gradient_attacks") or {}
        gcell = [] if not grads else ["" if g is None else f"{g:.3f} ({max(kinds, key=kinds.get)})"]
        sp = r.get("speculative")
        if specs:
            gcell += ["", ""] if not sp else [
                f"{sp['released']} (+{sp['released_beyond_plain']})",
                f"{sp['token_recovery']:.3f} ({sp['best_attack']}; {sp['token_recovery_rejected'] or 0:.3f})"]
        cells = ([cut if len(r["cut"]) == 1 else f"U {cut}", _defense(r), f"{ft} steps" if ft else "no"]
                 + ([r.get("attacker_knows", "finetuned")] if knows else []) + [_eps(r)]
                 + [f"{r['attacks'][a]:.3f}" if a in r["attacks"] else "" for a in attacks]
                 + [f"**{r['token_recovery']:.3f}** ({r['best_attack']})"] + gcell + [f"{r['perplexity']:.2f}",
                    f"{r['perplexity'] / undef:.2f}"]
                 + ([] if not control else ["" if r.get("perplexity_control") is None
                                            else f"{r['perplexity'] / r['perplexity_control']:.2f}"])
                 + ["" if test_time is None else f"{test_time:.2f}",
                    "" if r.get("perplexity_without_server") is None else f"{r['perplexity_without_server']:.2f}"]
                 + ([] if not mean_update else ["" if r.get("perplexity_mean_update") is None
                                              else f"{r['perplexity_mean_update']:.2f}"])
                 + ["yes" if r["labels_reach_server"] else "no",
                    f"{r.get('finetune_seconds') or 0:.0f} + {r['seconds']:.0f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None, finetune=None, speculate=None) -> int:
    """The command; ``finetune``, ``speculate``: see :func:`run` (``python -m splitlearn.privacy``
    passes them)."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        data = run(args, finetune=finetune, speculate=speculate)
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
