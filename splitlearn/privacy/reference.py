"""A trained reference model for the meter: the unsplit model trained on the public part of the
shipped corpus, once, and cached (docs/PRIVACY.md, 'Measured')."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Optional, Union

import torch

from ..model.data import ByteTokenizer, lm_batches
from ..errors import ConfigError
from ..model.loading import load_model
from .meter import max_positions, split_corpus, windows

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$SPLITLEARN_CACHE/privacy``, default ``~/.cache/splitlearn/privacy``."""
    return Path(os.environ.get("SPLITLEARN_CACHE", "~/.cache/splitlearn")).expanduser() / "privacy"


def train_reference(source: str = "tiny-demo", *, steps: int = 300, batch_size: int = 16,
                    seq_len: int = 64, lr: float = 1e-3, seed: int = 0,
                    cache_dir: Union[str, Path, None] = None, progress: bool = True) -> Path:
    """Train ``source`` (a byte-vocabulary spec) on the public paragraphs for ``steps`` AdamW steps;
    return the ``save_pretrained`` directory, cached per setting under ``cache_dir`` (default
    :func:`default_cache_dir`)."""
    for name, v in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if not lr > 0:
        raise ConfigError(f"lr must be > 0, got {lr!r}")
    tag = f"{source.replace('/', '_').replace(':', '_')}-steps{steps}-b{batch_size}-t{seq_len}-lr{lr:g}-seed{seed}"
    out = Path(cache_dir or default_cache_dir()) / tag
    if (out / "config.json").is_file() and (out / "train.json").is_file():
        log.info("reference model cached at %s", out)
        return out
    model = load_model(source, seed=seed)
    if model.config.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"{source} has a vocabulary of {model.config.vocab_size}; the reference "
                          f"model is trained on bytes (257)")
    limit = max_positions(model.config)
    if limit and seq_len > limit:
        raise ConfigError(f"seq_len={seq_len} is longer than the model's positions (max_position_embeddings={limit})")
    tok = ByteTokenizer()
    public, private = split_corpus()
    ids = tok.encode("\n\n".join(public))
    held = windows(tok, private, seq_len)  # (N, T), never trained on
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=steps, desc=f"training {source}", unit="step")
        loss = None
        for batch in lm_batches(ids, batch_size, seq_len, seed=seed, steps=steps):
            loss = model(batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
        if bar is not None:
            bar.close()
    model.eval()
    with torch.no_grad():
        held_loss = model(held, labels=held).loss.item()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    info = {"source": source, "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
            "lr": lr, "seed": seed, "final_train_loss": loss.item(),
            "private_loss": held_loss, "private_perplexity": math.exp(held_loss)}
    (out / "train.json").write_text(json.dumps(info, indent=2))
    log.info("trained %s: train loss %.3f, private perplexity %.2f -> %s", source, loss.item(),
             math.exp(held_loss), out)
    return out


def reference_info(path: Union[str, Path]) -> Optional[dict]:
    """The ``train.json`` written next to a reference model, or None."""
    p = Path(path) / "train.json"
    return json.loads(p.read_text()) if p.is_file() else None


FINETUNE_JSON = "finetune.json"  # written next to a defense-fine-tuned model (splitlearn.apps.defensetrain)


def finetune_info(path: Union[str, Path]) -> Optional[dict]:
    """The ``finetune.json`` written next to a defense-fine-tuned model, or None."""
    p = Path(path) / FINETUNE_JSON
    return json.loads(p.read_text()) if p.is_file() else None
