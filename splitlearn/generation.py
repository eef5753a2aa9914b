"""Token-by-token generation over segments, local or remote.

The decode loop is written once (:func:`decode`) against a ``step`` function that maps the
new token ids (B, T) and the attention mask of the whole sequence so far (B, past + T) to the
logits of the last position (B, V). :func:`local_step` builds that function for a
:class:`~splitlearn.partition.Partition` in one process, each segment with its own KV cache;
the HTTP client builds one whose middle segment lives on a server.

Greedy decoding reproduces ``model.generate(do_sample=False)``: positions come from the mask
as ``generate`` derives them, and finished rows are filled with ``pad_token_id`` after
``eos_token_id``. Sampling applies temperature, then top-k, then top-p (Hugging Face's order)
and draws with a ``torch.Generator`` seeded by ``seed``, so a seed reproduces a sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from .errors import ConfigError
from .partition import Partition

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32  # tokens to add to each prompt
    do_sample: bool = False  # False: greedy (argmax)
    temperature: float = 1.0  # > 0; divides the logits before sampling
    top_k: Optional[int] = None  # keep the k most likely tokens (sampling only)
    top_p: Optional[float] = None  # keep the smallest set with this much probability, (0, 1]
    eos_token_id: Optional[int] = None  # stop a row at this token; None: never stop early
    pad_token_id: Optional[int] = None  # fill finished rows; defaults to eos_token_id
    seed: Optional[int] = None  # seeds the sampler for reproducible samples

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")


def next_tokens(logits: torch.Tensor, cfg: GenerationConfig,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """Choose one token per row from last-position logits (B, V) -> (B,)."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    scores = logits.float() / cfg.temperature  # (B, V)
    if cfg.top_k is not None:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1])).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1:
        # Nucleus sampling (Holtzman et al. 2020), as transformers' TopPLogitsWarper does it.
        sorted_scores, idx = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)


class DecodeState:
    """The decode loop's state for a batch of rows: mask so far, finished rows, sampler.

    :func:`decode` drives one; a caller that runs groups of rows on their own schedule (the
    client's pipelined decoder) drives one per group. Per row, greedy decoding does not
    depend on the other rows, so groups give the tokens one batch gives; sampling draws
    from one generator for the whole batch, so it must stay in one group.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 cfg: GenerationConfig):
        self.cfg = cfg
        self.mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)  # (B, L)
        self.generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        if cfg.do_sample and self.generator is None:
            self.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row (B,) from last-position logits (B, V); pad for finished rows."""
        tok = next_tokens(logits, self.cfg, self.generator)  # (B,)
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
           cfg: GenerationConfig) -> Iterator[torch.Tensor]:
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
    """Generate with the segments in one process: prompt + new tokens, (B, T + new).

    kwargs are :class:`GenerationConfig` fields (max_new_tokens, do_sample, ...).
    """
    cfg = GenerationConfig(**kwargs)
    out = [input_ids] + [t[:, None] for t in decode(local_step(parts), input_ids, attention_mask, cfg)]
    return torch.cat(out, dim=1)
