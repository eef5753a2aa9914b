"""``AutoSplitModelForCausalLM`` (docs/MODELS.md): a saved tiny Llama and Gemma 2 split against an
in-process U-shape server are the family's own classes with the family's state-dict names; the
forward, loss and gradients, an SGD training step on both sides, and generate() (greedy and
seeded sampling) equal the unsplit model. GPT-2 sources still give SplitGPT2LMHeadModel."""


import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM, ConfigError, SplitGPT2LMHeadModel

from serverproc import TENANTS, TOKEN, InprocServerProcess

LR = 0.05


def _server(d):
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    return InprocServerProcess((1, 3), optimizer="sgd", lr=LR, model=str(d / "model"),
                               extra=["--token-file", str(d / "tokens")])


@pytest.fixture(scope="module", params=["llama-gqa", "gemma2"])
def served(request, tmp_path_factory):
    """A server that no test trains (the training test starts its own)."""
    name = request.param
    d = tmp_path_factory.mktemp(name)
    fam.model(name).save_pretrained(d / "model")
    with _server(d) as srv:
        yield name, d / "model", srv


def split_of(d, srv):
    return AutoSplitModelForCausalLM.from_pretrained(str(d), server=srv.url, token=TOKEN)


def _pos(model, ids, mask):
    """The positions to give the stock class beside a split model given none: none (the stock
    class's own, which the split model uses too: tests/test_hf_family_positions.py)."""
    return None


def test_the_split_model_is_the_familys_class_with_its_names(served):
    name, d, srv = served
    model = split_of(d, srv)
    ref = AutoModelForCausalLM.from_pretrained(d)
    assert isinstance(model, type(ref))
    names = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.3.mlp.down_proj.weight" in names
    assert not any(k.startswith(("model.layers.1.", "model.layers.2.")) for k in names)  # the server's
    assert "lm_head.weight" in names or model.config.tie_word_embeddings
    model.remote.close()


def test_forward_loss_gradients_and_a_training_step_equal_the_unsplit(served, tmp_path):
    name, d, _ = served
    with _server(d.parent) as srv:
        _training_step(d, srv)


def _training_step(d, srv):
    model = split_of(d, srv).train()
    ref = AutoModelForCausalLM.from_pretrained(d).train()
    ids, mask = fam.padded()
    labels = ids.masked_fill(mask == 0, -100)
    pos = _pos(ref, ids, mask)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    assert torch.equal(out.logits, want.logits)
    assert torch.equal(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.equal(p.grad, grads[n].grad), n
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    opt.step()
    ref_opt.step()
    model.remote.flush()
    after = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # the server stepped too
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
    assert abs(after.item() - want.item()) < 1e-5
    model.remote.close()


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_generate_equals_the_unsplit(served, sample):
    name, d, srv = served
    check_generate_equals_the_unsplit(d, srv, sample)


def check_generate_equals_the_unsplit(d, srv, sample: bool) -> None:
    """The split model of folder ``d`` on ``srv``: a left-padded prompt's greedy or seeded-sampling
    tokens equal the unsplit model's, and they vary."""
    model = split_of(d, srv)
    ref = AutoModelForCausalLM.from_pretrained(d).eval()
    ids, mask = fam.padded()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=sample,
              pad_token_id=fam.PAD)
    torch.manual_seed(3)
    want = ref.generate(**kw)
    torch.manual_seed(3)
    got = model.generate(**kw)
    assert torch.equal(got, want)
    assert len(set(want[:, ids.shape[1]:].flatten().tolist())) > 1
    model.remote.close()


def test_gpt2_sources_keep_the_split_gpt2_classes(tmp_path):
    """The entry sends GPT-2 to SplitGPT2LMHeadModel (a spec name, offline)."""
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained("tiny", server=srv.url, token=TOKEN)
        assert isinstance(model, SplitGPT2LMHeadModel)
        model.remote.close()


def test_a_model_that_is_not_the_servers_is_refused(served, tmp_path):
    name, d, srv = served
    other = fam.model(name, seed=5)
    other.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not the server's"):
        split_of(tmp_path, srv)


def test_construct_directly_is_refused():
    with pytest.raises(TypeError, match="from_pretrained"):
        AutoSplitModelForCausalLM()



@pytest.fixture(scope="module", params=["llama-gqa", "gemma2"])
def served_2way(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(name + "-2way")
    fam.model(name).save_pretrained(d / "model")
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((2,), optimizer="sgd", lr=LR, model=str(d / "model"),
                             extra=["--token-file", str(d / "tokens")]) as srv:
        yield name, d / "model", srv


def test_two_way_generate_evaluation_and_loss_equal_the_unsplit(served_2way):
    """2-way: the server holds the norm and the head (Gemma 2's softcap there); generate() tokens,
    no-grad logits, and the loss with the client's gradients equal the unsplit model. Trains last."""
    name, d, srv = served_2way
    model = split_of(d, srv)
    assert model.lm_head is None and "model.norm.weight" not in model.state_dict()
    ref = AutoModelForCausalLM.from_pretrained(d).eval()
    ids, mask = fam.padded()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
              pad_token_id=fam.PAD)
    assert torch.equal(model.generate(**kw), ref.generate(**kw))
    pos = _pos(ref, ids, mask)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    assert torch.allclose(got.logits, want.logits, rtol=0, atol=1e-5)
    assert abs(got.loss.item() - want.loss.item()) < 1e-5
    model.train()
    ref.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
    assert torch.equal(loss.detach(), want.detach())
    loss.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    # a tied embedding (Gemma 2's) is two tensors in 2-way, the server's head its own copy (as GPT-2's):
    # its gradient here is the embedding's part only
    tied = {"model.embed_tokens.weight"} if ref.config.tie_word_embeddings else set()
    checked = 0
    for n, p in model.named_parameters():
        if n in grads and n not in tied:
            assert torch.allclose(p.grad, grads[n].grad, rtol=0, atol=1e-6), n
            checked += 1
    assert checked > 5
    model.remote.steps.discard()
    model.remote.close()
