"""What ``python -m splitlearn.client train`` adds around the training loop: a ``--save``
folder that holds a run is never overwritten by accident, a Ctrl-C ends in one line that says
how to resume, a hub id that cannot be fetched fails at once, and held-out evaluation with
early stopping (docs/GUIDE.md, "Training from the command line").
"""
from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..errors import ConfigError

# torch is imported where it is used: a Ctrl-C during the command's first imports (torch's own,
# half done) still gets its one line from main, which imports this module then.

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the exit status of a command ended by SIGINT (128 + 2), as a shell reports it


# -- the --save folder ----------------------------------------------------------------------

def run_in(directory) -> Optional[str]:
    """What run ``directory`` holds, in words (None: none): a client checkpoint or a journal."""
    d = Path(directory)
    if not d.is_dir():
        return None
    latest = d / "client.latest"
    wal = d / "wal"
    records = len(list(wal.glob("*.safetensors"))) if wal.is_dir() else 0
    if not latest.exists() and not records:
        return None
    step = None
    if latest.exists():
        from ..model.checkpoint import latest as latest_gen, read_meta

        try:
            step = read_meta(latest_gen(d, "client"))["counters"].get("step")
        except Exception:  # noqa: BLE001 - a damaged one is still a run; --resume names what is wrong
            step = None
    return f"a run (client checkpoint at step {step})" if step is not None else "a run's journal"


def check_save(save: Optional[str], resume: Optional[str], overwrite: bool) -> None:
    """Before a run starts: a ``--save`` folder holding a run is not started over without
    ``--resume`` or ``--overwrite`` (ConfigError naming both); with ``--overwrite`` the old run's
    checkpoint and journal are removed (nothing else in the folder is touched)."""
    if not save or resume:
        return
    held = run_in(save)
    if held is None:
        return
    if not overwrite:
        raise ConfigError(f"--save {save} holds {held}: continue it with --resume {save}, or start over "
                          f"(removing it) with --overwrite")
    d = Path(save)
    shutil.rmtree(d / "wal", ignore_errors=True)
    for p in d.glob("client-*"):
        if p.is_dir() and re.fullmatch(r"client-\d+(\.tmp)?", p.name):  # a generation (model/checkpoint.py)
            shutil.rmtree(p, ignore_errors=True)
    for name in ("client.latest", "client.latest.tmp"):
        (d / name).unlink(missing_ok=True)
    log.info("--overwrite: removed the run in %s", save)


def resume_command(argv: Sequence[str], directory: str) -> str:
    """The command line that resumes the run ``argv`` started: ``--save DIR`` becomes
    ``--resume DIR`` (``--overwrite`` dropped), as a shell would take it."""
    out, skip = [], False
    resumed = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--overwrite":
            continue
        if a in ("--save", "--resume"):
            skip = True
            if not resumed:
                out += ["--resume", directory]
                resumed = True
            continue
        if a.startswith(("--save=", "--resume=")):
            if not resumed:
                out += ["--resume", directory]
                resumed = True
            continue
        out.append(a)
    if not resumed:
        out += ["--resume", directory]
    return shlex.join([Path(sys.executable).name, "-m", "splitlearn.client", *out])


def interrupted_line(done: int, steps: int, save: Optional[str], argv: Sequence[str]) -> str:
    """The one line a Ctrl-C prints."""
    where = f"interrupted at step {done + 1} ({done} of {steps} done)"
    if not save:
        return f"{where}; nothing was saved to resume from (train with --save DIR to make a run resumable)"
    if run_in(save) is None:  # interrupted before its first checkpoint: the same command starts it
        return f"{where}; rerun with: {shlex.join([Path(sys.executable).name, '-m', 'splitlearn.client', *argv])}"
    return f"{where}; rerun with: {resume_command(argv, save)}"


# -- the model source -------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_hub_source(source: str, timeout_s: float = 5.0) -> None:
    """A hub id that is neither cached nor reachable fails now, once, naming HF_HUB_OFFLINE=1
    (instead of transformers' retries, each warning printed by the tokenizer and the model).
    A spec name, a local path, a cached id, or ``HF_HUB_OFFLINE=1`` (the cache only, no network)
    is left to the loader."""
    from ..model.specs import is_spec_source  # not .loading: no torch yet (see cmd_train)

    if not isinstance(source, str) or Path(source).exists() or not _HUB_ID.match(source) or \
            is_spec_source(source):
        return
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return
    cached = try_to_load_from_cache(source, "config.json")
    if isinstance(cached, str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"--model {source}: HF_HUB_OFFLINE=1 is set and {source!r} is not in the Hugging Face "
                          f"cache ({constants.HF_HUB_CACHE}): download it once with network, or pass a local "
                          f"directory")
    import requests

    try:
        requests.head(constants.ENDPOINT, timeout=timeout_s)
    except requests.RequestException as e:
        raise ConfigError(f"--model {source}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                          f"{constants.ENDPOINT} cannot be reached ({type(e).__name__}): download it once with "
                          f"network, or pass a local directory; offline, set HF_HUB_OFFLINE=1 so that only the "
                          f"cache is used") from None


# -- --export-merged: the server's permission, before the first step ----------------------------

def check_weight_export(client) -> None:
    """``train --export-merged DIR`` needs the server's segment weights at the end
    (``GET /v1/clients/<id>/weights``, which the operator allows with ``--allow-weight-export``).
    Asked before the first step: a server that refuses them (``/v1/info``'s ``you.weight_export``
    false) answers that route with its 403 and reason now, which is raised, before any step is
    trained. (The refusal is answered before the server reads a weight: a cheap request.)"""
    from ..api import protocol as P
    from ..errors import Forbidden, SplitLearnError

    if client.info.get("you", {}).get("weight_export", True):
        return  # allowed (or a server that does not say: its answer at the end decides)
    try:
        client.transport.get_bytes(P.CLIENT_WEIGHTS.format(client_id=client.client_id))
    except SplitLearnError as e:
        raise Forbidden(f"--export-merged: the server will not give its weights: {e.message} "
                        f"(nothing was trained)") from None


# -- evaluation while training ----------------------------------------------------------------

def eval_windows(ids: Sequence[int], seq_len: int, max_rows: int):
    """The held-out token stream as consecutive, non-overlapping rows of ``seq_len`` tokens, at
    most ``max_rows`` of them (the same rows at every evaluation). ConfigError if not one fits."""
    import torch

    n = min(len(ids) // seq_len, max_rows)
    if n < 1:
        raise ConfigError(f"--eval-data has {len(ids)} tokens, fewer than one row of --seq-len {seq_len}")
    return torch.tensor(list(ids[:n * seq_len]), dtype=torch.long).view(n, seq_len)


class Evaluation:
    """Held-out loss and perplexity every ``every`` steps, and early stopping: ``patience``
    evaluations in a row without a loss below the best so far stop the run (0: never)."""

    def __init__(self, rows, every: int, patience: int = 0, batch_size: int = 64):
        if every < 1:
            raise ConfigError(f"--eval-every must be >= 1, got {every}")
        if patience < 0:
            raise ConfigError(f"--early-stop-patience must be >= 0, got {patience}")
        self.rows, self.every, self.patience, self.batch_size = rows, every, patience, batch_size
        self.history: list[dict] = []
        self.best: Optional[dict] = None
        self.since_best = 0

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or (last and (not self.history or self.history[-1]["step"] != step))

    def run(self, client, step: int) -> dict:
        """Evaluate ``client`` on the rows (in batches; the client splits what its server cannot
        take at once); the result, kept in :attr:`history`."""
        total = count = 0.0
        for s in range(0, self.rows.shape[0], self.batch_size):
            part = self.rows[s:s + self.batch_size]
            n = part.shape[0] * (part.shape[1] - 1)
            total += client.evaluate(part) * n
            count += n
        loss = total / count
        entry = {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}
        self.history.append(entry)
        if self.best is None or loss < self.best["loss"]:
            self.best, self.since_best = entry, 0
        else:
            self.since_best += 1
        return entry

    @property
    def stop(self) -> bool:
        """Early stop: ``patience`` evaluations without a better loss."""
        return bool(self.patience) and self.since_best >= self.patience

