"""``python -m splitlearn.client {train,generate,info,diagnose}``: the client's command line.

The options of :class:`~splitlearn.client.config.ClientConfig` (and the server's URL) are
generated from its fields (:mod:`splitlearn.procs.clihelp`): each is written once, with its default
and its help, in :mod:`splitlearn.client.config` and :mod:`splitlearn.hf.config`; the options
written here are the commands' own (the data, the steps, the prompt...)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from ..procs.clihelp import DefaultsHelpFormatter, add_options, options_of
from ..errors import ConfigError, SplitLearnError
from ..hf.config import ModelOptions, RemoteConfig
from .config import ClientConfig, Compute, Optimizer

# torch, transformers and requests are imported by the commands that use them, so that `--help`
# and a mistyped option answer at once (issue 41: 6 s on a quiet 2-core machine before).


def _token(args) -> Optional[str]:
    """--token-file's first line, else $SPLITLEARN_TOKEN."""
    return options_of(RemoteConfig, args).get("token") or os.environ.get("SPLITLEARN_TOKEN")


def _defense(args):
    """The --noise-sigma/--noise-clip (GaussianNoise) or --nopeek (NoPeek) defense, or None."""
    from ..privacy import GaussianNoise, NoPeek

    sigma, nopeek = getattr(args, "noise_sigma", None), getattr(args, "nopeek", None)
    if sigma is not None and nopeek is not None:
        raise SplitLearnError("give either --noise-sigma or --nopeek, not both")
    if sigma is not None:
        return GaussianNoise(sigma=sigma, clip=args.noise_clip)
    return NoPeek(weight=nopeek) if nopeek is not None else None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}MB"


def cmd_info(args) -> int:
    from ..api import protocol as P
    from ..transport import Transport, TransportConfig

    t = Transport(TransportConfig(args.server, _token(args), retries=1))
    print(json.dumps(t.get_json(P.INFO), indent=2))
    return 0


def cmd_diagnose(args) -> int:
    from ..analysis.diagnose import DiagnoseConfig, diagnose, render
    from ..transport import Transport, TransportConfig

    sizes = [int(float(x) * 1024) for x in args.sizes_kib.split(",") if x.strip()]
    cfg = DiagnoseConfig(sizes=tuple(sizes), repeats=args.repeats, train_batch=args.batch_size,
                         train_seq=args.seq_len, decode_batch=args.decode_batch)
    t = Transport(TransportConfig(args.server, _token(args), retries=1, connect_timeout_s=5.0))
    try:
        report = diagnose(t, cfg)
    finally:
        t.close()
    print(json.dumps(report, indent=1) if args.json else render(report), end="" if not args.json else "\n")
    return 0


def cmd_train(args) -> int:
    from .runs import Evaluation, check_hub_source, check_save, check_weight_export, eval_windows

    # what is refused without a model: before torch's and transformers' seconds of imports
    if args.sync_every is not None and args.sync_every < 1:
        raise SplitLearnError(f"--sync-every must be >= 1, got {args.sync_every}")
    if args.export_adapter and not args.lora:
        raise SplitLearnError("--export-adapter needs --lora")
    if args.save_every is not None and (args.save_every < 1 or not args.save):
        raise SplitLearnError("--save-every N needs N >= 1 and --save DIR")
    if (args.eval_every is not None or args.early_stop_patience) and not args.eval_data:
        raise SplitLearnError("--eval-every and --early-stop-patience need --eval-data FILE")
    check_save(args.save, args.resume, args.overwrite)  # a folder holding a run: --resume or --overwrite
    check_hub_source(args.model)  # an unreachable hub id: now, once
    from tqdm import tqdm

    from ..model.data import CORPUS, get_tokenizer, lm_batches
    from ..model.inputs import read_tokens
    from ..hf.unsplit import export_merged
    from .core import SplitClient

    tok = get_tokenizer(args.model)
    ids = read_tokens(tok, args.data or CORPUS, args.data_format, args.text_field)
    held_out = read_tokens(tok, args.eval_data, args.data_format, args.text_field, split=("validation", "test")) \
        if args.eval_data else None
    save_dir = args.save or args.resume  # kept current: a killed client resumes from it exactly
    config = ClientConfig(**options_of(ClientConfig, args), journal_dir=save_dir, defense=_defense(args),
                          lora="server" if args.lora else None)
    with SplitClient(args.server, args.model, config=config) as client:
        client.check_batch(args.batch_size, args.seq_len)  # before anything is sent: the model's and server's limits
        if args.export_merged:
            check_weight_export(client)  # the server's permission now, not after the whole run
        evaluation = Evaluation(eval_windows(held_out, args.seq_len, args.eval_rows), args.eval_every or 50,
                                args.early_stop_patience or 0) if held_out is not None else None
        start = client.load(args.resume) if args.resume else 0
        args.progress = start  # (main's line on a Ctrl-C)
        batches = lm_batches(ids, args.batch_size, args.seq_len, seed=config.seed)
        for _ in range(start):  # the batch of step i depends on the seed and i only
            next(batches)
        first = last = None
        t0 = time.perf_counter()
        bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train",
                   unit="step", file=sys.stderr, disable=args.quiet)
        federated = client.federation.mode != "shared"
        for i in bar:
            loss = client.train_step(next(batches))
            first = loss if first is None else first
            last = loss
            if federated and args.sync_every and (i + 1 - start) % args.sync_every == 0:
                client.sync()
            if args.save_every and (i + 1) % args.save_every == 0:
                client.save(save_dir)
            args.progress = i + 1
            s = client.stats
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{loss:.3f}",
                            tok_s=f"{(bar.n + 1 - start) * args.batch_size * args.seq_len / elapsed:.0f}",
                            wire=_mb(s.bytes_sent + s.bytes_received))
            if evaluation is not None and evaluation.due(i + 1, last=i + 1 == args.steps):
                e = evaluation.run(client, i + 1)
                bar.write(f"step {i + 1}: eval loss {e['loss']:.4f}, perplexity {e['perplexity']:.2f}",
                          file=sys.stderr)
                if evaluation.stop:
                    b = evaluation.best
                    bar.write(f"early stop at step {i + 1}: the eval loss has not improved for "
                              f"{evaluation.patience} evaluations (best {b['loss']:.4f} at step {b['step']})",
                              file=sys.stderr)
                    break
        if federated and (not args.sync_every or (args.progress - start) % args.sync_every):
            client.sync()  # end of this client's turn / round
        if save_dir:
            client.save(save_dir)
        if args.export_adapter:
            client.export_adapter(args.export_adapter)
        if args.export_merged:  # the whole model: client, server (--allow-weight-export) and adapters merged
            export_merged(client.model, args.export_merged, tok)
        s = client.stats
        done = args.progress - start
        summary = {
            "steps": done, "first_loss": first, "last_loss": last,
            "seconds": round(time.perf_counter() - t0, 2),
            "tokens_per_s": round(done * args.batch_size * args.seq_len / max(time.perf_counter() - t0, 1e-9), 1),
            "stats": s.as_dict(), "saved": save_dir,
        }
        if evaluation is not None:
            summary.update(evals=evaluation.history, best_eval=evaluation.best,
                           early_stopped=evaluation.stop)
        from ..privacy.spent import describe as describe_spent, spent  # the privacy this run spent
        summary["privacy"] = spent(config.defense, windows=max(done, 1) * args.batch_size, seq_len=args.seq_len,
                                   tokens=len(ids)) if done else None
        print(f"trained {done} steps: loss {first:.4f} -> {last:.4f} in {summary['seconds']}s, "
              f"{summary['tokens_per_s']} tokens/s, {s.calls} calls, sent {_mb(s.bytes_sent)}, "
              f"received {_mb(s.bytes_received)}, overhead {s.overhead_s / max(s.calls, 1) * 1e3:.2f} ms/call"
              if done else "nothing to do: already at --steps", file=sys.stderr)
        if done and config.defense is not None:
            print(describe_spent(summary["privacy"]), file=sys.stderr)
        if args.json:
            print(json.dumps(summary))
    return 0


def _trained_client(directory: str) -> tuple[dict, dict]:
    """(counters, weights) of the client that ``train --save DIR`` left in ``directory``: its
    id, step and cuts, and the state dict of its model (LoRA: with its adapters)."""
    from ..model.checkpoint import has_state, latest, read_extra, read_meta

    if not has_state(directory, "client"):
        raise ConfigError(f"--load {directory}: no trained client there (`train --save DIR` writes one)")
    counters = read_meta(latest(directory, "client"))["counters"]
    return counters, read_extra(directory, "client", "model") or {}


def _load_into(client, directory: str, counters: dict, weights: dict) -> None:
    """Put the trained client's weights into ``client``'s model; ConfigError if they are not
    this server's split (other cuts, other blocks)."""
    if tuple(counters["cuts"]) != tuple(client.cuts):
        raise ConfigError(f"--load {directory}: trained at cuts {counters['cuts']}, the server has "
                          f"{list(client.cuts)}")
    missing = client.model.state_dict().keys() ^ weights.keys()
    if missing:
        raise ConfigError(f"--load {directory}: the saved client does not fit this model "
                          f"({len(missing)} weights differ, e.g. {sorted(missing)[0]!r})")
    client.model.load_state_dict(weights)


def cmd_generate(args) -> int:
    from .runs import check_hub_source

    check_hub_source(args.model)  # an unreachable hub id: now, once, before torch's seconds of imports
    import torch

    from ..model.data import get_tokenizer
    from .core import SplitClient
    tok = get_tokenizer(args.model)
    if args.prompt_ids is not None:
        prompt = [int(x) for x in args.prompt_ids.split()]
    else:
        prompt = tok.encode(args.prompt)
    if not prompt:
        raise SplitLearnError("the prompt is empty")
    ids = torch.tensor([prompt])
    sampling = not args.greedy and (args.temperature != 1.0 or args.top_k or args.top_p
                                    or args.sample_seed is not None)
    trained = _trained_client(args.load) if args.load else None
    options = options_of(ClientConfig, args)
    if trained is not None:  # the trained client's id (its server-side weights where a mode keeps them apart)
        trained_id = trained[0]["client_id"]
        if options.get("client_id", trained_id) != trained_id:
            raise ConfigError(f"--load {args.load}: trained as client {trained_id!r}, not --client-id "
                              f"{options['client_id']!r}")
        options["client_id"] = trained_id
        options["lora"] = "server" if any("lora_" in k for k in trained[1]) else None
    with SplitClient(args.server, args.model, config=ClientConfig(**options, defense=_defense(args))) as client:
        if trained is not None:
            _load_into(client, args.load, *trained)
            print(f"loaded the client saved at step {trained[0]['step']} in {args.load}", file=sys.stderr)
        t0 = time.perf_counter()
        new: list[int] = []
        printed = ""
        try:
            for t in client.generate_stream(ids, max_new_tokens=args.max_new_tokens, do_sample=sampling,
                                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                            seed=args.sample_seed, eos_token_id=args.eos_token_id):
                if not args.json and not new:  # the prompt once the first token came: a refused
                    sys.stdout.write(tok.decode(prompt))  # request prints no half line
                new.append(int(t[0]))
                if not args.json:
                    text = tok.decode(new)
                    if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                        sys.stdout.write(text[len(printed):])
                        sys.stdout.flush()
                        printed = text
        except BaseException:
            if new and not args.json:  # the error (main prints it) on a line of its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
        seconds = time.perf_counter() - t0
        stats = {**client.stats.as_dict(), "seconds": seconds, "tokens_per_s": len(new) / max(seconds, 1e-9)}
    if args.json:
        print(json.dumps({"ids": [prompt + new], "text": [tok.decode(prompt + new)], "stats": stats}))
    else:
        if not new:
            sys.stdout.write(tok.decode(prompt))
        sys.stdout.write(tok.decode(new)[len(printed):] + "\n")
        print(f"{len(new)} tokens in {seconds:.2f}s ({stats['tokens_per_s']:.1f} tokens/s)", file=sys.stderr)
    return 0


def _with_formatter(add_parser):
    """``add_parser`` whose parsers show each option's default (the subcommands' --help)."""
    return lambda *a, **kw: add_parser(*a, formatter_class=DefaultsHelpFormatter, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitlearn.client", allow_abbrev=False,
                                description="splitlearn client: train or generate with a split causal LM "
                                            "(GPT-2 or any family of docs/MODELS.md)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser = _with_formatter(sub.add_parser)

    def defense(sp, nopeek: bool):
        sp.add_argument("--noise-sigma", type=float, help="defense: clip each activation token to "
                        "--noise-clip, add Gaussian noise of std sigma*clip (docs/PRIVACY.md)")
        sp.add_argument("--noise-clip", type=float, default=1.0, help="per-token L2 clip of --noise-sigma")
        if nopeek:
            sp.add_argument("--nopeek", type=float, help="defense: NoPeek distance-correlation loss weight")

    def common(sp, model=True, training=True):
        """The generated options: the server's URL and token alone (``model=False``), or every
        ClientConfig option (``training=False``: less the optimizer's and ``micro_batches``;
        ``--model-seed`` for ``seed``, whose ``--seed`` is the sampler's)."""
        sp.allow_abbrev = False  # subparsers do not inherit it: `--mode` must not mean `--model`
        if not model:
            add_options(sp, RemoteConfig, only=("server", "token"))
            return
        add_options(sp, RemoteConfig)
        sp.add_argument("--model", required=True, help="the model source the server was started with")
        add_options(sp, ModelOptions, skip=() if training else ("micro_batches",),
                    flags=None if training else {"seed": "--model-seed"})
        if training:
            add_options(sp, Optimizer)
        add_options(sp, Compute)

    info = sub.add_parser("info", help="print the server's /v1/info")
    common(info, model=False)
    info.set_defaults(func=cmd_info)

    dg = sub.add_parser("diagnose", allow_abbrev=False,
                        help="measure the link to a server: round trips, bandwidth, codec, step costs")
    common(dg, model=False)
    dg.add_argument("--json", action="store_true", help="print the report as JSON")
    dg.add_argument("--sizes-kib", default="1,16,256,1024,4096,16384",
                    help="echo payload sizes in KiB, comma-separated (default 1 KiB .. 16 MiB)")
    dg.add_argument("--repeats", type=int, default=5, help="round trips per size (median reported)")
    dg.add_argument("--batch-size", type=int, default=8, help="rows of the training step estimated")
    dg.add_argument("--seq-len", type=int, default=128, help="tokens per row of the training step estimated")
    dg.add_argument("--decode-batch", type=int, default=1, help="rows of the decode step estimated")
    dg.set_defaults(func=cmd_diagnose)

    tr = sub.add_parser("train", help="train the split model on a text file, JSON lines or a datasets dataset")
    common(tr)
    tr.add_argument("--data", help="training text: a UTF-8 text file, e.g. this owner's shard, a .jsonl file or a "
                    "directory saved by datasets' save_to_disk (its train split) (default: the corpus shipped "
                    "with splitlearn)")
    tr.add_argument("--data-format", default="auto", choices=("auto", "text", "jsonl", "dataset"),
                    help="how --data and --eval-data are read (auto: a directory is a dataset, .jsonl/.json JSON "
                    "lines, anything else text)")
    tr.add_argument("--text-field", default="text", help="the field of a JSON line, or column of a dataset, "
                    "holding the text")
    tr.add_argument("--eval-data", help="held-out text in the same formats (a dataset's validation or test split): "
                    "its loss and perplexity every --eval-every steps")
    tr.add_argument("--eval-every", type=int, help="evaluate on --eval-data every N steps (default 50), and at "
                    "the end")
    tr.add_argument("--eval-rows", type=int, default=64, help="rows of --seq-len tokens of --eval-data evaluated "
                    "(the first ones, the same each time)")
    tr.add_argument("--early-stop-patience", type=int, help="stop when the eval loss has not improved for this "
                    "many evaluations in a row")
    tr.add_argument("--steps", type=int, required=True, help="train until this many steps are done")
    tr.add_argument("--batch-size", type=int, default=8, help="rows per step")
    tr.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    tr.add_argument("--save", help="keep the client's state here: a snapshot at the server's checkpoints plus "
                    "a log of every step since, so a killed client resumes exactly; saved at the end too")
    tr.add_argument("--save-every", type=int, help="also save (and have the server checkpoint) every N steps")
    tr.add_argument("--resume", help="resume from a --save directory (and keep saving there)")
    tr.add_argument("--overwrite", action="store_true", help="start a new run in a --save directory that holds "
                    "one (its checkpoint and journal are removed); without it such a directory is refused")
    tr.add_argument("--lora", action="store_true", help="train LoRA adapters with the server's options "
                    "(a server started with --lora-r); the base weights stay frozen on both sides")
    tr.add_argument("--export-adapter", metavar="DIR", help="with --lora: write this client's adapter "
                    "(both sides) to DIR as a peft adapter directory at the end")
    tr.add_argument("--export-merged", metavar="DIR", help="at the end, save the whole trained model (the client's "
                    "and the server's weights, LoRA merged; the tokenizer beside it) to DIR for "
                    "AutoModelForCausalLM.from_pretrained; the server must allow it (--allow-weight-export)")
    tr.add_argument("--sync-every", type=int, help="federation: share client-side weights every N steps "
                    "(sequential: end of a turn; splitfed: end of a round); always at the end")
    tr.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    defense(tr, nopeek=True)
    tr.set_defaults(func=cmd_train)

    ge = sub.add_parser("generate", help="generate text, streaming it as it comes")
    common(ge, training=False)
    src = ge.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help='prompt token ids, e.g. "1 2 3"')
    ge.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    ge.add_argument("--greedy", action="store_true", help="argmax decoding (the default unless sampling flags are given)")
    ge.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ge.add_argument("--top-k", type=int, help="sample from the k likeliest tokens (default: all)")
    ge.add_argument("--top-p", type=float, help="nucleus sampling: the likeliest tokens of this mass (default: 1)")
    ge.add_argument("--seed", type=int, dest="sample_seed", help="seed of the sampler (sampling is reproducible "
                    "with it)")
    ge.add_argument("--eos-token-id", type=int, help="stop at this token")
    ge.add_argument("--load", metavar="DIR", help="generate with the client that `train --save DIR` trained "
                    "(without it the client's blocks are the model source's, untrained)")
    ge.add_argument("--json", action="store_true", help='print {"ids", "text", "stats"} and nothing else on stdout')
    defense(ge, nopeek=False)
    ge.set_defaults(func=cmd_generate)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SplitLearnError, ValueError, OSError) as e:
        sys.stdout.flush()  # what was printed comes before the error
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what the run owed the server was sent on the way out (docs/RECOVERY.md)
        from .runs import INTERRUPTED, interrupted_line

        sys.stdout.flush()
        if args.command == "train":
            print(("\n" if sys.stderr.isatty() else "") + interrupted_line(getattr(args, "progress", 0), args.steps, args.save or args.resume, argv),
                  file=sys.stderr)
        else:
            print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED
