"""partition(model, cuts): the split equals the whole, and bad cuts or models are refused.

The core invariant: chaining the segments gives the unsplit model's logits, loss and the
gradient of every parameter, for every valid cut of the tiny model (2-way and U-shape,
c = 0 and c = n_layer included), with and without left padding.
"""
import copy

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from conftest import N_LAYER, all_cuts, hf_forward
from splitlearn import ConfigError, Partition, partition, validate_cuts
from splitlearn.model.partition import whole
from splitlearn.model.segments import labels_from_batch

ATOL = 1e-5


# -- structure and sharing ---------------------------------------------------------------

@pytest.mark.parametrize("cuts", all_cuts())
def test_segment_kinds_and_block_ranges(tiny_model, cuts):
    parts = partition(tiny_model, cuts)
    bounds = [0, *cuts, N_LAYER]
    kinds = ["bottom", "top"] if len(cuts) == 1 else ["bottom", "trunk", "top"]
    assert isinstance(parts, Partition) and parts.cuts == tuple(cuts)
    assert [s.kind for s in parts] == kinds
    assert [s.blocks for s in parts] == list(zip(bounds[:-1], bounds[1:]))
    assert parts.u_shape == (len(cuts) == 2)
    assert (parts.trunk is None) == (len(cuts) == 1)
    assert parts.bottom.input_kind() == "ids" and parts.top.has_head


def test_int_cut_is_a_two_way_split(tiny_model):
    assert partition(tiny_model, 2).cuts == (2,)


@pytest.mark.parametrize("cuts", [(2,), (1, 3), (0, 4)])
def test_segments_share_the_models_parameters(tiny_model, cuts):
    parts = partition(tiny_model, cuts)
    model_ptrs = {p.data_ptr() for p in tiny_model.parameters()}
    seg_params = [p for s in parts for p in s.parameters()]
    assert all(p.data_ptr() in model_ptrs for p in seg_params)
    # every model parameter is in exactly one segment (wte/lm_head is one tensor, two uses)
    assert {id(p) for p in seg_params} == {id(p) for p in tiny_model.parameters()}
    tr = tiny_model.transformer
    assert parts.bottom.wte.weight is tr.wte.weight
    assert parts.top.lm_head.weight is parts.bottom.wte.weight  # still tied in-process
    for seg in parts:
        for i, block in enumerate(seg.h):
            assert block is tr.h[seg.start + i]


def test_training_a_segment_trains_the_model(tiny_model, batch):
    model = copy.deepcopy(tiny_model)
    parts = partition(model, (1, 3))
    before = model.transformer.h[2].mlp.c_fc.weight.detach().clone()
    unique = {id(p): p for s in parts for p in s.parameters()}  # wte is lm_head: once
    opt = torch.optim.SGD(list(unique.values()), lr=0.1)
    parts.loss(batch).backward()
    opt.step()
    assert not torch.equal(model.transformer.h[2].mlp.c_fc.weight, before)


def test_whole_is_the_unsplit_model(tiny_model, padded_batch):
    ids, mask = padded_batch
    logits = whole(tiny_model)(ids, mask)
    torch.testing.assert_close(logits, hf_forward(tiny_model, ids, mask).logits, rtol=0, atol=ATOL)


# -- exactness: split == unsplit ---------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("cuts", all_cuts())
def test_split_equals_unsplit(tiny_model, batch, padded_batch, cuts, padded):
    """Logits, loss and every parameter's gradient match the unsplit model."""
    ids, mask = padded_batch if padded else (batch, None)
    params = list(tiny_model.parameters())
    ref = hf_forward(tiny_model, ids, mask, labels=labels_from_batch(ids, mask))
    ref_grads = torch.autograd.grad(ref.loss, params)

    parts = partition(tiny_model, cuts)
    logits = parts(ids, mask)
    loss = parts.loss(ids, mask)
    grads = torch.autograd.grad(loss, params)

    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(loss, ref.loss, rtol=0, atol=ATOL)
    names = [n for n, _ in tiny_model.named_parameters()]
    for name, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_split_gradient_of_tied_weight_sums_both_uses(tiny_model, batch):
    """wte.weight's gradient includes the lm_head use: not equal to the embedding use alone."""
    wte = tiny_model.transformer.wte.weight
    parts = partition(tiny_model, 2)
    (g_both,) = torch.autograd.grad(parts.loss(batch), [wte])
    ref = tiny_model(batch, labels=batch)
    (g_ref,) = torch.autograd.grad(ref.loss, [wte])
    torch.testing.assert_close(g_both, g_ref, rtol=1e-4, atol=ATOL)
    hidden = parts.bottom(batch)
    (g_head_only,) = torch.autograd.grad(parts.top(hidden.detach()).sum(), [wte])
    assert g_head_only.abs().sum() > 0  # the head's use alone also reaches wte


# -- refused input -----------------------------------------------------------------------

@pytest.mark.parametrize("cuts, message", [
    ((5,), "out of range"),
    ((-1,), "out of range"),
    ((0, 5), "out of range"),
    ((3, 1), "sorted"),
    ((2, 2), "duplicated"),
    ((1, 2, 3), "got 3"),
    ((), "got 0"),
    ((1.0,), "integers"),
    (("2",), "integers"),
    ((True,), "integers"),
    (2.5, "integer"),
    (None, "integer"),
])
def test_bad_cuts_are_refused(tiny_model, cuts, message):
    with pytest.raises(ConfigError, match=message):
        partition(tiny_model, cuts)


def test_validate_cuts_returns_a_tuple():
    assert validate_cuts(3, 4) == (3,)
    assert validate_cuts([0, 4], 4) == (0, 4)


def tiny_bert():
    return BertModel(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=16))


@pytest.mark.parametrize("make", [lambda: nn.Linear(4, 4), tiny_bert], ids=["linear", "bert"])
def test_a_model_that_is_not_gpt2_is_refused(make):
    """Refused with the supported list (docs/MODELS.md)."""
    with pytest.raises(ConfigError, match="verified: llama.*gpt2"):
        partition(make(), 1)


def test_gpt2_base_model_without_head_is_refused(tiny_model):
    with pytest.raises(ConfigError, match="GPT2Model"):
        partition(tiny_model.transformer, 1)


def test_split_equals_unsplit_in_training_mode(tiny_model, padded_batch):
    """The tiny spec has no dropout, so train mode is as exact as eval mode."""
    model = copy.deepcopy(tiny_model).train()
    ids, mask = padded_batch
    ref = hf_forward(model, ids, mask, labels=labels_from_batch(ids, mask))
    parts = partition(model, (1, 3))
    assert all(seg.training for seg in parts)
    torch.testing.assert_close(parts.loss(ids, mask), ref.loss, rtol=0, atol=ATOL)
