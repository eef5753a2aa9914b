"""Which optimizer's step applies the server's (splitlearn/hf/optlink.py), against in-process
servers (U-shape 1,3, SGD), on GPT-2 (``SplitGPT2LMHeadModel``) and a tiny Llama
(``AutoSplitModelForCausalLM``): the attacks are a user's, not a server's.

- A second optimizer made while the first is alive (a re-created optimizer, a second
  ``Trainer`` run): before, its steps never reached the server (the search for optimizers
  stopped at the first one found; its ``zero_grad`` then discarded the server's pending step):
  only the client trained, silently. Now every one of its steps applies, the first still
  does when it steps again, and both sides equal the unsplit model's steps (1e-6).
- An optimizer stepped and thrown away (``torch.optim.SGD(model.parameters(), lr).step()``):
  gone before its step could be found, so the server cannot step with it: a warning naming
  ``model.attach_optimizer(opt)``, and the server's weights unchanged.
"""
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam

from serverproc import TENANTS, InprocServerProcess
from test_hf_auto import LR, _pos, split_of


@pytest.fixture(params=["gpt2", "llama-mha"])
def served(request, tmp_path):
    """(the saved tiny model's folder, its fresh server)."""
    d = tmp_path / "model"
    fam.model(request.param).save_pretrained(d)
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR, model=str(d), checkpoint_dir=tmp_path / "ckpt",
                             extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        yield d, srv


def _same_weights(model, ref, srv, stepped_from=None):
    """Every weight, the client's and the server's, equals the unsplit ``ref``'s (1e-6)."""
    model.remote.flush()
    want = ref.state_dict()
    server = srv.weights()
    assert server
    for n, w in {**server, **model.state_dict()}.items():
        if ".remote." in n:
            continue
        key = n if n in want else "transformer." + n  # (GPT-2's server names its blocks without the prefix)
        torch.testing.assert_close(w, want[key], rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        if stepped_from is not None and w.dim() == 2 and n in server:
            assert not torch.equal(w, stepped_from[key]), f"{n}: the server did not step"


def _train_step(model, ref, opt, ref_opt):
    ids, mask = fam.padded()
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    pos = {} if ref.config.model_type == "gpt2" else {"position_ids": _pos(ref, ids, mask)}  # (GPT-2's own: 0..T-1)
    ref(input_ids=ids, attention_mask=mask, labels=labels, **pos).loss.backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


def test_a_second_optimizer_made_while_the_first_lives_steps_the_server(served):
    """``a`` steps once; ``b`` is made while ``a`` lives and steps twice (each step's
    ``zero_grad`` right after it): every step applies on the server (before: applies stayed at
    1, ``b``'s zero_grad discarded its steps); ``a`` stepping again still applies. Both sides
    equal the unsplit model after its same four SGD steps."""
    d, srv = served
    model = split_of(d, srv).train()
    ref = AutoModelForCausalLM.from_pretrained(d).train()
    start = {n: w.clone() for n, w in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    a = torch.optim.SGD(model.parameters(), lr=LR)
    _train_step(model, ref, a, ref_opt)
    model.remote.flush()
    assert model.remote.applies == 1
    b = torch.optim.SGD(model.parameters(), lr=LR)  # a re-created optimizer; a still alive
    for n in (2, 3):
        _train_step(model, ref, b, ref_opt)
        model.remote.flush()
        assert model.remote.applies == n and model.remote.last_apply["pieces"] == 1
    _train_step(model, ref, a, ref_opt)  # the first one again
    model.remote.flush()
    assert model.remote.applies == 4 and model.remote.step == 5
    _same_weights(model, ref, srv, stepped_from=start)
    model.remote.close()


def test_an_optimizer_stepped_and_thrown_away_warns_and_the_server_does_not_step(served, caplog):
    d, srv = served
    model = split_of(d, srv).train()
    before = srv.weights()
    ids, mask = fam.padded()
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with caplog.at_level(logging.WARNING, logger="splitlearn.hf.optlink"):
        torch.optim.SGD(model.parameters(), lr=LR).step()  # gone at once
        model.remote.flush()
    assert any("model.attach_optimizer(opt)" in r.getMessage() for r in caplog.records), caplog.text
    assert model.remote.applies == 0
    model.zero_grad()
    model.remote.close()  # its pending gradients dropped on the server
    assert all(torch.equal(w, before[n]) for n, w in srv.weights().items())


def test_an_attached_optimizer_replaced_while_alive_warns_and_once_gone_its_successor_applies(served, caplog):
    """``model.attach_optimizer(a)``: only ``a``'s steps apply. Another optimizer stepping while
    ``a`` lives is refused clearly (a warning naming attach_optimizer, the server not stepped;
    before: silently); once ``a`` is collected, the optimizers over the model apply again (before:
    none did, ever, and only the client trained). Both sides then equal the unsplit model's."""
    d, srv = served
    model = split_of(d, srv).train()
    ref = AutoModelForCausalLM.from_pretrained(d).train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    a = model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    _train_step(model, ref, a, ref_opt)
    b = torch.optim.SGD(model.parameters(), lr=LR)
    ids, mask = fam.padded()
    labels = ids.masked_fill(mask == 0, -100)
    model.remote.flush()  # a's step
    before = srv.weights()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with caplog.at_level(logging.WARNING, logger="splitlearn.hf.optlink"):
        b.step()
        b.zero_grad()
        model.remote.flush()
    assert any("attach_optimizer" in r.getMessage() for r in caplog.records), caplog.text
    assert model.remote.applies == 1 and all(torch.equal(w, before[n]) for n, w in srv.weights().items())
    # the unsplit model as the split one is now: b's step on the client side only
    ref.load_state_dict({**ref.state_dict(), **{n if n in ref.state_dict() else "transformer." + n: w
                                                 for n, w in {**model.state_dict(), **before}.items()
                                                 if ".remote." not in n}})
    del a  # gone: b's steps apply from now on
    for n in (2, 3):
        _train_step(model, ref, b, ref_opt)
        model.remote.flush()
        assert model.remote.applies == n
    _same_weights(model, ref, srv, stepped_from=before)
    model.remote.close()


def test_with_peft_a_second_optimizer_over_the_adapters_steps_the_server(served):
    """peft freezes the proxy: an optimizer's step shows as a trainable (adapter) parameter moved.
    ``b`` over the adapters, made while ``a`` lives: each of its steps applies on the server
    (before: its zero_grad discarded them), and the server's weights move."""
    peft = pytest.importorskip("peft")
    d, srv = served
    base = split_of(d, srv).train()
    gpt2 = base.config.model_type == "gpt2"
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, fan_in_fan_out=gpt2,
                                                      target_modules=["c_attn"] if gpt2 else ["q_proj"]))
    assert not base.remote.grad_proxy.requires_grad
    ids, mask = fam.padded()
    labels = ids.masked_fill(mask == 0, -100)
    a = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    a.step()
    a.zero_grad()
    base.remote.flush()
    before = srv.weights()
    b = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for n in (2, 3):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        b.step()
        b.zero_grad()
        base.remote.flush()
        assert base.remote.applies == n
    assert any(not torch.equal(w, before[n]) for n, w in srv.weights().items())
    base.remote.close()
