"""Cached decoding through the segments in one process, against ``model.generate``.

Generation is transformers' ``generate`` over ``RemoteCache`` (tests/test_hf_generation.py,
tests/test_client_generation.py, the row groups included). What runs under it on the server, and
in the export checks, is :class:`~splitlearn.model.segments.Segment` with its
:class:`~splitlearn.model.segments.SegmentCache`, one position at a time: fed the tokens ``generate``
chose (the prompt, then one token per step), every cut's segments must choose them too, for
left-padded batches, without a mask, and for rows that finished (eos) while others go on.
"""
from typing import Optional

import pytest
import torch

from conftest import all_cuts
from splitlearn import partition

NEW = 8


def cached_choices(segments, ids: torch.Tensor, mask: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Feed ``out`` (B, T + N), a prompt ``ids`` (B, T) and N tokens, through ``segments``, each
    with its own cache: the prompt at once, then one token per step, ``mask`` (None: none)
    extended by a column of ones per step as ``generate`` extends it. Returns the greedy choice
    after each step, (B, N)."""
    caches = [s.new_cache() for s in segments]
    T, N = ids.shape[1], out.shape[1] - ids.shape[1]
    choices, new = [], ids
    for i in range(N):
        m = None if mask is None else torch.cat([mask, torch.ones_like(out[:, T:T + i])], dim=1)
        x = new
        with torch.no_grad():
            for seg, cache in zip(segments, caches):
                x = seg(x, m, cache, logits_to_keep=1)  # ignored by segments without the head
        choices.append(x[:, -1].argmax(-1))  # (B,)
        new = out[:, T + i:T + i + 1]  # (B, 1): what generate chose
    return torch.stack(choices, dim=1)


def assert_same_choices(segments, ids, mask, out, eos: Optional[int] = None) -> None:
    """The segments choose every token of ``out`` that ``generate`` chose for a running row (a
    row that produced ``eos`` holds padding after it)."""
    gen = out[:, ids.shape[1]:]  # (B, N)
    choices = cached_choices(segments, ids, mask, out)
    running = torch.ones_like(gen, dtype=torch.bool)
    if eos is not None:  # a row runs until the step after its first eos
        running[:, 1:] = (gen[:, :-1] == eos).cumsum(dim=1) == 0
    assert torch.equal(choices[running], gen[running])


def hf_greedy(model, ids, mask, eos, max_new_tokens=NEW, pad=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos if pad is None else pad)


@pytest.mark.parametrize("cuts", all_cuts())
def test_cached_segments_choose_generates_tokens_left_padded(tiny_model, padded_batch, cuts):
    ids, mask = padded_batch
    eos = tiny_model.config.eos_token_id
    out = hf_greedy(tiny_model, ids, mask, eos)
    assert out.shape == (ids.shape[0], ids.shape[1] + NEW)
    assert_same_choices(partition(tiny_model, cuts), ids, mask, out, eos)


@pytest.mark.parametrize("cuts", [(2,), (1, 3)])
def test_cached_segments_without_mask(tiny_model, batch, cuts):
    out = tiny_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert_same_choices(partition(tiny_model, cuts), batch, None, out)


@pytest.mark.parametrize("cuts", [(0,), (1, 3)])
def test_a_finished_row_is_padded_while_the_others_go_on(tiny_model, padded_batch, cuts):
    """Make the token row 0 emits first the eos: row 0 then holds pads, the others run on,
    and the segments still choose the running rows' tokens."""
    ids, mask = padded_batch
    first = hf_greedy(tiny_model, ids, mask, None, max_new_tokens=1, pad=0)[:, -1]
    eos = int(first[0])
    pad = 0 if eos != 0 else 1
    out = hf_greedy(tiny_model, ids, mask, eos, pad=pad)
    T = ids.shape[1]
    assert out[0, T] == eos and (out[0, T + 1:] == pad).all()
    assert out.shape[1] > T + 1 and (out[1:, T + 1:] != pad).any()  # the other rows went on
    assert_same_choices(partition(tiny_model, cuts), ids, mask, out, eos)
