"""A split model given no ``position_ids`` uses the stock class's own (docs/MODELS.md, PI).

The stock classes of transformers 5 given none take ``arange`` past the cache (every family of
tests/families.py but OPT, which derives them from the mask; GPT-2's learned positions too), the
server derives them from the mask (``cumsum - 1``) when none arrive. So the split model's training
and evaluation forwards (no generation cache) use ``arange`` and send it with the request where it
differs from the mask's (a padded batch); an unpadded batch sends nothing more. Every family, U-shape
(1, 3) and 2-way (2), one in-process server per family and shape: a left-padded batch whose first
real token is a target (predicted from the last pad's logits) with no ``position_ids`` gives the
stock class's loss and every client gradient bit for bit.

The attack (what the split model did before): positions from the mask on a left-padded row. Rotary
keeps the loss, but Gemma 2's eager attention backpropagates through the pad's wholly masked query
row, so its gradients follow the positions a pad is given: 2e-2 apart from the stock class's
(checked below: the comparison can fail)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn.api import protocol as P
from splitlearn.model.arch import arch_of

from serverproc import TENANTS, InprocServerProcess
from test_hf_auto import LR, split_of

CUTS = {"u": (1, 3), "2way": (2,)}
_SAVED = {}  # family -> its saved folder


@pytest.fixture(scope="module", params=[(n, s) for n in fam.NAMES for s in CUTS],
                ids=[f"{n}-{s}" for n in fam.NAMES for s in CUTS])
def served(request, tmp_path_factory):
    """(name, shape, the saved model's folder, its server)."""
    name, shape = request.param
    d = tmp_path_factory.mktemp(f"{name}-{shape}")
    if name not in _SAVED:  # one folder per family, both shapes' servers load it
        _SAVED[name] = tmp_path_factory.mktemp(name) / "model"
        fam.model(name).save_pretrained(_SAVED[name])
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(CUTS[shape], optimizer="sgd", lr=LR, model=str(_SAVED[name]),
                             extra=["--token-file", str(d / "tokens")]) as srv:
        yield name, shape, _SAVED[name], srv


def _batch():
    """Row 0 left-padded by 3: its first real token (column 3) is a target, from the last pad."""
    ids, mask = fam.padded()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _checked(model, ref):
    """The client's parameters to compare: all but a tied embedding in 2-way (the server's head is
    its own copy there, so the client's gradient is the embedding's part only)."""
    names = {n for n, _ in model.named_parameters() if ".remote." not in n}
    if getattr(model, arch_of(ref.config).head_name, None) is None and ref.config.tie_word_embeddings:
        tied = {n for n, p in ref.named_parameters() if p is ref.get_input_embeddings().weight}
        names -= tied
    return names


def _recording(model):
    """Patch the model's request bodies: -> the list of whether each carried ``position_ids``."""
    steps, sent = model.remote.steps, []
    inner = steps.forward_tensors

    def forward_tensors(*args, **kwargs):
        tensors = inner(*args, **kwargs)
        sent.append(P.POSITIONS in tensors)
        return tensors
    steps.forward_tensors = forward_tensors
    return sent


def test_no_position_ids_give_the_stock_classs_loss_and_gradients(served):
    """Training (gradients on): the loss, U-shape's logits and every client gradient bit for bit
    (``torch.equal``) the stock class's given none; evaluation (``torch.no_grad()``): the loss
    within 1e-6, the logits within 1e-5. Gemma 2 (eager): the mask's positions are 2e-2 off."""
    name, shape, d, srv = served
    model = split_of(d, srv).train()
    ref = AutoModelForCausalLM.from_pretrained(d).train()
    ids, mask, labels = _batch()
    assert labels[0, 3] != -100 and mask[0, 2] == 0  # the first real token is a target, from a pad
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(out.loss.detach(), want.loss.detach())
    if shape == "u":
        assert torch.equal(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    stock = _grads(ref)
    names = _checked(model, ref)
    assert len(names) > 2
    for n, p in model.named_parameters():
        if n in names:
            assert torch.equal(p.grad, stock[n]), (n, float((p.grad - stock[n]).abs().max()))
    if name == "gemma2":  # the mask's positions (the old default) give other gradients here
        ref.zero_grad()
        pos = arch_of(ref.config).positions(mask, 0, ids.shape[1])
        ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
        off = max(float((g - stock[n]).abs().max()) for n, g in _grads(ref).items() if n in names)
        assert off > 1e-3, off
    model.zero_grad()  # no step: the server discards the step's pieces
    model.eval()
    ref.eval()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
    model.remote.close()


def test_positions_travel_only_where_the_server_would_derive_others(served):
    """An unpadded batch's requests carry no ``position_ids`` (the server's from the mask are the
    same); a left-padded one's carry the client's (``arange``), training and evaluation, except
    where the client's are the mask's too (OPT) or the server's layers take none (GPT-2)."""
    name, shape, d, srv = served
    model = split_of(d, srv).train()
    sent = _recording(model)
    ids, mask, labels = _batch()
    full = torch.ones_like(mask)
    model(input_ids=ids, attention_mask=full, labels=ids).loss.backward()
    model.zero_grad()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=full, labels=ids)
        model(input_ids=ids, labels=ids)
    assert sent == [False] * 3
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    model.zero_grad()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, labels=labels)
    carries = name not in ("opt", "gpt2")
    assert sent[3:] == [carries] * 2
    model.remote.close()
