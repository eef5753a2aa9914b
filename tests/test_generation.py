"""Local generation through the segments, each with its own KV cache, against model.generate."""
import pytest
import torch

from conftest import all_cuts
from splitlearn import ConfigError, partition
from splitlearn.generation import GenerationConfig, generate, next_tokens

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


def test_sampling_with_a_seed_is_reproducible(tiny_model, padded_batch):
    ids, mask = padded_batch
    parts = partition(tiny_model, (1, 3))
    kw = dict(max_new_tokens=16, do_sample=True, temperature=1.5)
    a = generate(parts, ids, mask, seed=123, **kw)
    b = generate(parts, ids, mask, seed=123, **kw)
    c = generate(parts, ids, mask, seed=124, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(a[:, :ids.shape[1]], ids)


def test_sampling_does_not_touch_the_global_rng(tiny_model, batch):
    parts = partition(tiny_model, 2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    generate(parts, batch, None, max_new_tokens=4, do_sample=True, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_top_k_one_is_greedy(tiny_model, padded_batch):
    ids, mask = padded_batch
    parts = partition(tiny_model, 2)
    greedy = generate(parts, ids, mask, max_new_tokens=NEW)
    sampled = generate(parts, ids, mask, max_new_tokens=NEW, do_sample=True, top_k=1, seed=0)
    assert torch.equal(greedy, sampled)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    cfg = GenerationConfig(do_sample=True, top_p=0.8)
    gen = torch.Generator().manual_seed(0)
    drawn = {int(next_tokens(logits, cfg, gen)) for _ in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", -1), ("temperature", 0.0), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5),
])
def test_bad_generation_config_is_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        GenerationConfig(**{field: value})
