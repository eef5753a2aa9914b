"""Greedy decoding through the segments in one process, each with its own KV cache (the loop the
pipelined decode runs per row group), against model.generate."""
import pytest
import torch

from conftest import all_cuts
from splitlearn import ConfigError, partition
from splitlearn.generation import GreedyConfig, generate

NEW = 8


def hf_greedy(model, ids, mask, eos, max_new_tokens=NEW):
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)


@pytest.mark.parametrize("cuts", all_cuts())
def test_greedy_equals_hf_generate_left_padded(tiny_model, padded_batch, cuts):
    ids, mask = padded_batch
    eos = tiny_model.config.eos_token_id
    out = generate(partition(tiny_model, cuts), ids, mask, max_new_tokens=NEW,
                   eos_token_id=eos, pad_token_id=eos)
    assert out.shape == (ids.shape[0], ids.shape[1] + NEW)
    assert torch.equal(out, hf_greedy(tiny_model, ids, mask, eos))


@pytest.mark.parametrize("cuts", [(2,), (1, 3)])
def test_greedy_without_mask(tiny_model, batch, cuts):
    out = generate(partition(tiny_model, cuts), batch, None, max_new_tokens=NEW)
    ref = tiny_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("cuts", [(0,), (1, 3)])
def test_finished_rows_are_padded_and_generation_stops(tiny_model, padded_batch, cuts):
    """Make the token row 0 emits first the eos: row 0 then holds pads, like HF's output."""
    ids, mask = padded_batch
    parts = partition(tiny_model, cuts)
    eos = int(generate(parts, ids, mask, max_new_tokens=1)[0, -1])
    pad = 0 if eos != 0 else 1
    out = generate(parts, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad)
    ref = tiny_model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(out, ref)
    assert out[0, ids.shape[1]] == eos and (out[0, ids.shape[1] + 1:] == pad).all()


def test_generation_stops_when_every_row_is_done(tiny_model, tokenizer):
    ids = tokenizer(["Hi"])["input_ids"]
    parts = partition(tiny_model, 2)
    eos = int(generate(parts, ids, None, max_new_tokens=1)[0, -1])
    out = generate(parts, ids, None, max_new_tokens=NEW, eos_token_id=eos)
    assert out.shape == (1, ids.shape[1] + 1)


@pytest.mark.parametrize("value", [-1, 2.5])
def test_bad_max_new_tokens_is_refused(value):
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GreedyConfig(max_new_tokens=value)
    with pytest.raises(TypeError):  # sampling is transformers' generate: no such field here
        GreedyConfig(do_sample=True)
