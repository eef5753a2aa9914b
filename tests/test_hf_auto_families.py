"""``AutoSplitModelForCausalLM`` on every family of tests/families.py (docs/MODELS.md, Y), as
tests/test_hf_auto.py checks it on Llama GQA and Gemma 2: a saved tiny model split against an
in-process server (U-shape 1,3 and 2-way 2, one server per family and shape) is the family's own
class with the family's state-dict names; a left-padded batch's logits, loss and every client
gradient equal the unsplit model's; one SGD step on both sides equals the unsplit step (the next
loss, every weight on both sides); greedy and seeded-sampling generate() tokens equal the unsplit
model's, decoding past the sliding window (4) where the family has one; 2-way as K.
GPT-2 sources go to ``SplitGPT2LMHeadModel`` (H), not tested here."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn.model.arch import arch_of

from serverproc import TENANTS, InprocServerProcess
from test_hf_auto import LR, _pos, check_generate_equals_the_unsplit, split_of

NAMES = [n for n in fam.NAMES if n != "gpt2"]
CUTS = {"u": (1, 3), "2way": (2,)}
_SAVED = {}  # family -> its saved folder


@pytest.fixture(scope="module", params=[(n, s) for n in NAMES for s in CUTS],
                ids=[f"{n}-{s}" for n in NAMES for s in CUTS])
def served(request, tmp_path_factory):
    """(name, shape, the saved model's folder, its server); the training test of each runs last."""
    name, shape = request.param
    d = tmp_path_factory.mktemp(f"{name}-{shape}")
    if name not in _SAVED:  # one folder per family, both shapes' servers load it
        _SAVED[name] = tmp_path_factory.mktemp(name) / "model"
        fam.model(name).save_pretrained(_SAVED[name])
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(CUTS[shape], optimizer="sgd", lr=LR, model=str(_SAVED[name]),
                             checkpoint_dir=d / "ckpt", extra=["--token-file", str(d / "tokens")]) as srv:
        yield name, shape, _SAVED[name], srv


def _batch():
    ids, mask = fam.padded()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_the_split_model_is_the_familys_class_with_its_names(served):
    name, shape, d, srv = served
    model = split_of(d, srv)
    ref = AutoModelForCausalLM.from_pretrained(d)
    assert isinstance(model, type(ref)) and type(model).__name__ == f"Split{type(ref).__name__}"
    prefix = arch_of(ref.config).layer_prefix()
    server_layers = (1, 2) if shape == "u" else (2, 3)
    theirs = {k for k in ref.state_dict() if k.startswith(tuple(f"{prefix}.{i}." for i in server_layers))}
    mine = {k for k in model.state_dict() if ".remote." not in k}  # the link's own (grad_proxy)
    assert theirs and not mine & theirs  # the server's layers are not the client's
    want = set(ref.state_dict()) - theirs
    if shape == "2way":  # the server also holds the final norm and the head
        head = arch_of(ref.config).head_name
        held = want - mine
        assert mine < want and f"{head}.weight" in held
        assert all(k.startswith(head + ".") or "norm" in k or "ln_f" in k for k in held), held
        assert not any(k.startswith(prefix + ".") for k in held)
    else:
        assert mine == want
    model.remote.close()


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_generate_equals_the_unsplit(served, sample):
    """Left-padded prompt of 7, 6 new tokens: past a sliding window of 4 in the prompt and the steps."""
    name, shape, d, srv = served
    check_generate_equals_the_unsplit(d, srv, sample)


def test_forward_loss_gradients_and_a_training_step_equal_the_unsplit(served):
    """U-shape: logits, loss and every client gradient bit for bit; after one SGD step on both sides
    every weight, the client's and the server's, within 1e-6, generate() on the stepped weights the
    unsplit tokens, the next loss within 1e-5. 2-way (K): no-grad logits and loss
    within 1e-5, a training forward's loss bit for bit, the client's gradients within 1e-6.
    Runs last on its server (it trains it)."""
    name, shape, d, srv = served
    model = split_of(d, srv).train()
    ref = AutoModelForCausalLM.from_pretrained(d).train()
    ids, mask, labels = _batch()
    pos = _pos(ref, ids, mask)
    if shape == "2way":
        _two_way(model, ref, ids, mask, labels, pos)
        return
    start = {n: w.clone() for n, w in ref.state_dict().items()}
    opt = model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=LR))  # (no search for it)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    assert torch.equal(out.logits, want.logits)
    assert torch.equal(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    _same_grads(model, ref)
    opt.step()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    model.remote.flush()
    server = _same_weights(model, ref, srv)
    assert all(not torch.equal(w, start[n]) for n, w in server.items() if w.dim() == 2)  # it stepped
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, pad_token_id=fam.PAD)
    assert torch.equal(model.eval().generate(**kw), ref.eval().generate(**kw))  # on the stepped weights
    model.train()
    ref.train()
    after = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
    assert abs(after.item() - want.item()) < 1e-5
    model.remote.steps.discard()
    model.remote.close()


def test_an_optimizer_made_after_the_backward_is_applied_by_flush(tmp_path):
    """An optimizer made after the backward (as in I) is not hooked when it steps: ``flush()`` (and
    so generate()'s cache) sends its step, as ``close()`` and the next training forward do (before,
    flush() sent nothing and generate() read the server's weights before the step)."""
    d = tmp_path / "model"
    fam.model("llama-mha").save_pretrained(d)
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR, model=str(d), checkpoint_dir=tmp_path / "ckpt",
                             extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        model = split_of(d, srv).train()
        ref = AutoModelForCausalLM.from_pretrained(d).train()
        ids, mask, labels = _batch()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        ref(input_ids=ids, attention_mask=mask, position_ids=_pos(ref, ids, mask), labels=labels).loss.backward()
        opt = torch.optim.SGD(model.parameters(), lr=LR)  # made now (kept alive): found late
        opt.step()
        torch.optim.SGD(ref.parameters(), lr=LR).step()
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, pad_token_id=fam.PAD,
                  output_logits=True, return_dict_in_generate=True)
        got, want = model.eval().generate(**kw), ref.eval().generate(**kw)  # its cache flushed first
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-5)
        assert model.remote.applies == 1
        _same_weights(model, ref, srv)
        model.remote.close()


def _same_grads(model, ref):
    grads = dict(ref.named_parameters())
    checked = 0
    for n, p in model.named_parameters():
        if ".remote." not in n:  # (the link's grad_proxy)
            assert torch.equal(p.grad, grads[n].grad), n
            checked += 1
    assert checked > 5


def _same_weights(model, ref, srv):
    stepped = ref.state_dict()
    server = srv.weights()
    assert server and not set(server) & set(model.state_dict())
    for n, w in {**server, **model.state_dict()}.items():
        if ".remote." not in n:
            torch.testing.assert_close(w, stepped[n], rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    return server


def _two_way(model, ref, ids, mask, labels, pos):
    assert getattr(model, arch_of(ref.config).head_name) is None  # the server holds the head
    model.eval()
    ref.eval()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    assert torch.allclose(got.logits, want.logits, rtol=0, atol=1e-5)
    assert abs(got.loss.item() - want.loss.item()) < 1e-5
    model.train()
    ref.train()
    opt = model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=LR))  # (no search for it)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
    assert torch.equal(loss.detach(), want.detach())
    loss.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    # a tied embedding is two tensors in 2-way (the server's head its own copy, as K): its part only
    tied = {n for n, p in ref.named_parameters() if p is ref.get_input_embeddings().weight} \
        if ref.config.tie_word_embeddings else set()
    checked = 0
    for n, p in model.named_parameters():
        if n not in tied and ".remote." not in n:
            assert torch.allclose(p.grad, grads[n].grad, rtol=0, atol=1e-6), n
            checked += 1
    assert checked > 2
    opt.zero_grad()  # no step: the server discards the step's pieces
    model.remote.close()

