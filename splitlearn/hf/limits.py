"""What a split model checks before it sends (issue 51, item 6): positions past the model's,
rows past the server's limit.

The server refuses a sequence longer than the model's positions (the config's
``max_position_embeddings``, every family's name) and a request of more rows than its ``--max-batch``
(400, "takes 1..N rows"); both limits are in its ``/v1/info`` (``limits.max_position_embeddings``,
``limits.max_batch``). The split classes apply them on this side (:mod:`.trunk`,
:mod:`.familytrunk`, :mod:`.remote`, :mod:`.pieces`, :mod:`.generation` call this module):

- a forward whose sequence (past positions + new ones) passes the model's positions, or whose
  ``position_ids`` do, is a ``ConfigError`` naming the limit, before the client computes or sends
  anything (an unsplit model with learned positions: a raw ``IndexError`` in its position
  embedding); so is ``generate(max_new_tokens=n)`` whose prompt + ``n`` passes it;
- a no-grad forward (evaluation) of more rows than the server takes goes as several requests of
  at most ``max_batch`` rows: the answers (trunk outputs, logits) are concatenated and the loss
  is the whole batch's (each group's mean weighted by its targets), as one request would give;
- ``generate()`` with more rows than the server takes (prompts x ``num_beams`` or
  ``num_return_sequences``) runs one ``generate`` per group of prompts and pads each group's
  output on the right with the pad token to the longest (what transformers does to a row that
  finished early): greedy and beam search give one batch's tokens; sampling draws each group's
  tokens in turn. A streamer, ``return_dict_in_generate`` or a cache of the caller's with more
  rows is a ``ConfigError`` (their per-step outputs cannot be one batch's);
- a forward with gradients (training) of more rows than the server takes is a ``ConfigError``
  before it is sent: the caller chooses the batch (smaller batches, or ``micro_batches``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import ConfigError

IGNORE = -100  # the label the causal-LM loss skips

#: the tensors of a ``generate`` call that hold one row per prompt (sliced into groups)
ROW_INPUTS = ("inputs", "input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids")


def max_rows(info: dict) -> Optional[int]:
    """Rows the server takes in one request (its ``--max-batch``; None: it does not say)."""
    rows = (info.get("limits") or {}).get("max_batch")
    return int(rows) if rows else None


def max_positions(info: dict, config) -> Optional[int]:
    """The model's positions: the server's ``limits.max_position_embeddings``, else the config's."""
    limits = info.get("limits") or {}
    n = limits.get("max_position_embeddings") or getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def check_positions(info: dict, config, length: int, position_ids: Optional[torch.Tensor] = None) -> None:
    """ConfigError if a sequence of ``length`` positions (past + new), or ``position_ids``,
    pass the model's positions."""
    limit = max_positions(info, config)
    if limit is None:
        return
    if length > limit:
        raise ConfigError(f"a sequence of {length} positions passes the model's {limit} positions "
                          f"(max_position_embeddings): use at most {limit} tokens per row, "
                          f"past ones included (nothing was sent)")
    if position_ids is not None and position_ids.numel() and int(position_ids.max()) >= limit:
        raise ConfigError(f"position_ids reach {int(position_ids.max())}, past the model's {limit} positions "
                          f"(max_position_embeddings: 0..{limit - 1}; nothing was sent)")


def check_training_rows(info: dict, rows: int) -> None:
    """ConfigError if a forward with gradients of ``rows`` rows passes the server's limit."""
    limit = max_rows(info)
    if limit is not None and rows > limit:
        raise ConfigError(f"a training forward of {rows} rows passes the server's {limit} rows per request "
                          f"(its --max-batch): train on at most {limit} rows per forward (or micro_batches "
                          f">= {-(-rows // limit)}); evaluation under torch.no_grad() and generate() split "
                          f"their rows by themselves (nothing was sent)")


def row_groups(info: dict, rows: int, per_row: int = 1) -> list[slice]:
    """``rows`` as groups of whole rows, each of at most the server's limit once every row is
    ``per_row`` rows on the server (one group if the server takes them all)."""
    limit = max_rows(info)
    if limit is None or rows * per_row <= limit:
        return [slice(0, rows)]
    step = max(limit // per_row, 1)
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


def _part(t: Optional[torch.Tensor], g: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[g]


def evaluate_in_groups(evaluate: Callable, groups: list[slice], hidden: torch.Tensor,
                       mask: Optional[torch.Tensor], labels: Optional[torch.Tensor]):
    """:meth:`RemoteSegment.evaluate <.remote.RemoteSegment.evaluate>` of a batch in row
    groups, one request each -> (the answers concatenated, the whole batch's loss or None).
    The loss is the mean over every target (labels past the first position, not -100): each
    group's mean weighted by its targets."""
    outs, losses, counts = [], [], []
    for g in groups:
        out, loss = evaluate(hidden[g], _part(mask, g), _part(labels, g))
        outs.append(out)
        if labels is not None:
            losses.append(loss)
            counts.append(int((labels[g][:, 1:] != IGNORE).sum()))
    out = None if outs[0] is None else torch.cat(outs, dim=0)
    if labels is None:
        return out, None
    total = sum(counts)
    if total == 0:  # no target anywhere: the mean of nothing, as one request answers it
        return out, losses[0]
    loss = sum(l.float() * (n / total) for l, n in zip(losses, counts) if n)
    return out, loss.to(losses[0].dtype)


# -- generate ----------------------------------------------------------------------------------

def _option(kwargs: dict, gc, name: str):
    return kwargs[name] if kwargs.get(name) is not None else getattr(gc, name, None)


def _inputs(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    if args and torch.is_tensor(args[0]):
        return args[0]
    for name in ("inputs", "input_ids", "inputs_embeds"):
        if torch.is_tensor(kwargs.get(name)):
            return kwargs[name]
    return None


def generate_groups(model, args: tuple, kwargs: dict) -> Optional[list[slice]]:
    """Check a ``generate`` call of a split model before it sends -> its groups of prompts
    (None: one call does). ConfigError for a prompt + ``max_new_tokens`` past the model's
    positions, or more rows than the server takes where groups cannot give one batch's output."""
    inputs = _inputs(args, kwargs)
    remote = getattr(model, "remote", None)
    if inputs is None or inputs.ndim < 2 or remote is None:
        return None
    info, gc = remote.info, kwargs.get("generation_config") or model.generation_config
    n = kwargs.get("max_new_tokens", getattr(kwargs.get("generation_config"), "max_new_tokens", None))
    if isinstance(n, int) and not isinstance(n, bool):
        limit = max_positions(info, model.config)
        if limit is not None and inputs.shape[1] + n > limit:
            raise ConfigError(f"a prompt of {inputs.shape[1]} tokens + max_new_tokens={n} passes the model's "
                              f"{limit} positions (max_position_embeddings; nothing was sent)")
    per_prompt = max(int(_option(kwargs, gc, "num_beams") or 1), int(_option(kwargs, gc, "num_return_sequences") or 1))
    limit, rows = max_rows(info), inputs.shape[0] * per_prompt
    if limit is None or rows <= limit:
        return None
    why = (f"generate() of {rows} rows ({inputs.shape[0]} prompts x {per_prompt}) passes the server's {limit} "
           f"rows per request (its --max-batch)")
    if per_prompt > limit:
        raise ConfigError(f"{why}, and one prompt's {per_prompt} rows (num_beams / num_return_sequences) "
                          f"already do: use at most {limit}")
    for name in ("cache", "past_key_values", "streamer", "assistant_model"):
        if kwargs.get(name) is not None:
            raise ConfigError(f"{why}; with {name}=... it cannot run as several calls: pass at most "
                              f"{limit // per_prompt} prompts per call")
    if _option(kwargs, gc, "return_dict_in_generate"):
        raise ConfigError(f"{why}; with return_dict_in_generate its per-step outputs cannot be one batch's: "
                          f"pass at most {limit // per_prompt} prompts per call")
    groups = row_groups(info, inputs.shape[0], per_prompt)
    return groups if len(groups) > 1 else None


def generate_in_groups(model, groups: list[slice], args: tuple, kwargs: dict) -> torch.Tensor:
    """``model.generate`` once per group of prompts -> the outputs, each padded on the right with
    the pad token to the longest, concatenated (rows in the prompts' order)."""
    def part(name, v, g):
        return v[g] if name in ROW_INPUTS and torch.is_tensor(v) else v

    outs = []
    for g in groups:
        a = ((args[0][g], *args[1:]) if args and torch.is_tensor(args[0]) else args)
        outs.append(model.generate(*a, **{k: part(k, v, g) for k, v in kwargs.items()}))
    width = max(o.shape[1] for o in outs)
    if all(o.shape[1] == width for o in outs):
        return torch.cat(outs, dim=0)
    gc = kwargs.get("generation_config") or model.generation_config
    pad = _option(kwargs, gc, "pad_token_id")
    if pad is None:  # transformers pads with the (first) eos then
        pad = _option(kwargs, gc, "eos_token_id")
    if isinstance(pad, (list, tuple)) or (torch.is_tensor(pad) and pad.ndim):
        pad = pad[0]
    pad = int(pad) if pad is not None else 0
    return torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad) for o in outs], dim=0)
