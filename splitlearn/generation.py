"""Greedy decoding over segments: the decode fast path, local or remote.

Generation is transformers' ``generate()`` on the split model classes (:mod:`splitlearn.hf`):
every strategy, sampler, logits processor and stopping rule is theirs. This module keeps only
what that cannot do: greedy decoding driven **one step at a time by the caller**, which the
client's pipelined decode needs (two row groups of one batch in flight on two server
sessions, :mod:`splitlearn.client.generation`) and which the export checks use to run
segments in one process.

The loop (:func:`decode`) is written against a ``step`` function that maps the new token ids
(B, T) and the attention mask of the whole sequence so far (B, past + T) to the logits of the
last position (B, V). :func:`local_step` builds that function for a
:class:`~splitlearn.partition.Partition` in one process, each segment with its own KV cache.
It reproduces ``model.generate(do_sample=False)`` token for token (tests/test_generation.py):
positions come from the mask as ``generate`` derives them, and finished rows are filled with
``pad_token_id`` after ``eos_token_id``. Greedy tokens of a row do not depend on the other
rows, which is what lets the pipelined decode split a batch into groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from .errors import ConfigError
from .partition import Partition

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GreedyConfig:
    """What greedy decoding needs (sampling, beams and the rest: transformers' ``generate``)."""

    max_new_tokens: int = 32  # tokens to add to each prompt
    eos_token_id: Optional[int] = None  # stop a row at this token; None: never stop early
    pad_token_id: Optional[int] = None  # fill finished rows; defaults to eos_token_id

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")


class DecodeState:
    """The decode loop's state for a batch of rows: mask so far, finished rows.

    :func:`decode` drives one; a caller that runs groups of rows on their own schedule (the
    client's pipelined decoder) drives one per group.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], cfg: GreedyConfig):
        self.cfg = cfg
        self.mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)  # (B, L)
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row (B,) from last-position logits (B, V); pad for finished rows."""
        tok = logits.argmax(-1)  # (B,)
        if self.cfg.eos_token_id is not None:
            tok = torch.where(self.unfinished, tok, torch.full_like(tok, self.pad))
            self.unfinished &= tok != self.cfg.eos_token_id
        return tok

    @property
    def done(self) -> bool:
        """Every row has produced ``eos_token_id`` (never, without one)."""
        return self.cfg.eos_token_id is not None and not bool(self.unfinished.any())

    def padding(self) -> torch.Tensor:
        """The tokens of a group whose rows are all done: (B,) of ``pad``."""
        return torch.full_like(self.unfinished, self.pad, dtype=torch.long)

    def advance(self, tok: torch.Tensor) -> torch.Tensor:
        """Append ``tok`` (B,) to the sequence: the next step's new ids (B, 1); extends the mask."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)  # (B, past + 1)
        return tok[:, None]  # (B, 1)


def decode(step: Step, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
           cfg: GreedyConfig) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), ``cfg.max_new_tokens`` times at most.

    The prompt goes through ``step`` once (prefill); every later call sends one position.
    Stops early when every row has produced ``eos_token_id``.
    """
    state = DecodeState(input_ids, attention_mask, cfg)
    new = input_ids
    for _ in range(cfg.max_new_tokens):
        tok = state.choose(step(new, state.mask))  # (B,)
        yield tok
        if state.done:
            return
        new = state.advance(tok)  # (B, 1)


def local_step(parts: Partition) -> Step:
    """A ``step`` running every segment of ``parts`` in this process, each with a KV cache."""
    caches = parts.new_caches()

    @torch.no_grad()
    def step(new_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = new_ids
        for seg, cache in zip(parts, caches):
            x = seg(x, mask, cache, logits_to_keep=1)  # ignored by segments without the head
        return x[:, -1, :]  # (B, V)

    return step


def generate(parts: Partition, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             **kwargs) -> torch.Tensor:
    """Greedy generation with the segments in one process: prompt + new tokens, (B, T + new).

    kwargs are :class:`GreedyConfig` fields (max_new_tokens, eos_token_id, pad_token_id).
    """
    cfg = GreedyConfig(**kwargs)
    out = [input_ids] + [t[:, None] for t in decode(local_step(parts), input_ids, attention_mask, cfg)]
    return torch.cat(out, dim=1)
