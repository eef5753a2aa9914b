"""splitlearn.model.headloss: the LM loss in chunks of positions equals the unchunked one, loss and
gradients, for any chunk size, with ignored targets, scaled losses and a whole top segment."""
import copy

import pytest
import torch

from conftest import hf_forward
from splitlearn import load_model, partition
from splitlearn.model.headloss import CHUNK_LOGITS_BYTES, chunk_rows, chunked_lm_loss, head_loss
from splitlearn.model.segments import labels_from_batch, loss_from_logits

V, D = 257, 32  # models/tiny.json


def _inputs(B=3, T=11, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)  # (B, T, d)
    w = torch.randn(V, D, generator=g) * 0.2  # (V, d)
    y = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        y[0, :4] = -100  # left padding
        y[2, 7] = -100
    return x, w, y


def _reference(x, w, y, scale=1.0):
    """Loss and gradients the way the server computed them before: whole (B, T, V) logits."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = loss_from_logits(x @ w.t(), y)  # logits (B, T, V)
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 30, None], ids=lambda r: f"rows={r}")
def test_chunked_loss_and_gradients_equal_the_whole_logits(rows):
    x, w, y = _inputs()
    ref_loss, ref_gx, ref_gw = _reference(x, w, y)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_lm_loss(xc, wc, y, rows=rows)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xc.grad, ref_gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wc.grad, ref_gw, rtol=1e-5, atol=1e-7)


def test_one_chunk_gives_the_same_loss_bit_for_bit():
    x, w, y = _inputs()
    ref_loss, ref_gx, _ = _reference(x, w, y)
    xc = x.clone().requires_grad_()
    loss = chunked_lm_loss(xc, w, y, rows=10_000)  # every position in one chunk
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert torch.equal(xc.grad, ref_gx)  # scaled before the product, as autograd scales it


@pytest.mark.parametrize("announced", [0.25, 1.0], ids=["announced", "not-announced"])
def test_a_scaled_loss_scales_the_gradients_and_no_grad_gives_the_same_loss(announced):
    x, w, y = _inputs(seed=1)
    _, ref_gx, ref_gw = _reference(x, w, y, scale=0.25)  # a micro-batch's loss_scale
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    (chunked_lm_loss(xc, wc, y, rows=4, grad_scale=announced) * 0.25).backward()
    torch.testing.assert_close(xc.grad, ref_gx, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(wc.grad, ref_gw, rtol=1e-5, atol=1e-8)
    if announced == 0.25:  # one chunk, announced: autograd's own numbers
        xc = x.clone().requires_grad_()
        (chunked_lm_loss(xc, w, y, rows=10_000, grad_scale=0.25) * 0.25).backward()
        assert torch.equal(xc.grad, ref_gx)
    with torch.no_grad():
        torch.testing.assert_close(chunked_lm_loss(x, w, y, rows=5), loss_from_logits(x @ w.t(), y),
                                   rtol=1e-6, atol=1e-6)


def test_frozen_weight_gets_no_gradient_and_only_x_is_differentiated():
    x, w, y = _inputs(seed=2)
    _, ref_gx, _ = _reference(x, w, y)
    xc = x.clone().requires_grad_()
    chunked_lm_loss(xc, w, y, rows=5).backward()  # w does not require grad (a LoRA server's head)
    assert w.grad is None
    torch.testing.assert_close(xc.grad, ref_gx, rtol=1e-5, atol=1e-8)


def test_all_targets_ignored_is_nan_like_the_reference():
    x, w, y = _inputs()
    y[:] = -100
    assert torch.isnan(chunked_lm_loss(x, w, y, rows=4)) and torch.isnan(loss_from_logits(x @ w.t(), y))


def test_a_second_backward_is_refused_not_silently_rescaled():
    x, w, y = _inputs()
    loss = chunked_lm_loss(x.clone().requires_grad_(), w.clone().requires_grad_(), y, rows=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_bfloat16_chunks_stay_close_to_float32():
    x, w, y = _inputs()
    ref_loss, ref_gx, _ = _reference(x, w, y)
    xb = x.bfloat16().requires_grad_()
    loss = chunked_lm_loss(xb, w.bfloat16(), y, rows=4)
    loss.backward()
    assert loss.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xb.grad.float(), ref_gx, rtol=5e-2, atol=5e-3)


def test_chunk_rows_take_a_fixed_budget_of_logits():
    assert chunk_rows(50257) == CHUNK_LOGITS_BYTES // (4 * 50257) == 333  # GPT-2: 64 MiB of logits
    assert chunk_rows(10**9) == 1


def test_top_segment_training_equals_the_unchunked_head(padded_batch):
    """A whole top's gradients (blocks, ln_f, lm_head) and the gradient of its input: the chunked
    loss against loss_from_logits on the full logits, as the server trained before."""
    ids, mask = padded_batch
    labels = labels_from_batch(ids, mask)
    model = load_model("tiny")
    bottom, top = partition(model, (2,))
    h = bottom(ids, mask).detach()  # (B, T, d)
    ref_top = copy.deepcopy(top)
    h_ref, h_new = h.clone().requires_grad_(), h.clone().requires_grad_()
    ref = loss_from_logits(ref_top(h_ref, mask), labels)
    ref.backward()
    new = head_loss(top, top(h_new, mask, head=False), labels, rows=5)
    new.backward()
    torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h_new.grad, h_ref.grad, rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(top.named_parameters(), ref_top.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    # and the loss is the unsplit Hugging Face model's (with its own, untied-in-value head)
    with torch.no_grad():
        whole = hf_forward(model, ids, mask, labels=labels).loss
    torch.testing.assert_close(new.detach(), whole, rtol=1e-5, atol=1e-6)
