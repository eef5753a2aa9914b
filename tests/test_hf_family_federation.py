"""The federation modes (splitlearn/hf/federation.py, server/federation/) with any family's split
class: two ``AutoSplitModelForCausalLM`` members of a tiny Llama (GQA), or Gemma 2 (its sliding
layers shorter than the rows, both softcaps), against a real in-process server. A SplitFed round equals one unsplit SGD step on the members' rows together (FedAvg of
SGD steps weighted by target tokens: the mean loss over the union); sequential turns equal the
unsplit steps in turn order. Both sides' weights are compared, under the family's names."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn.api import protocol as P
from splitlearn.hf.federation import client_weights

from serverproc import TENANTS, TOKEN, InprocServerProcess, auth, run_threads, web

LR, NAME = 0.05, "llama-gqa"
ATOL = 1e-6


def serve(tmp_path, cuts, *extra, name=NAME):
    fam.model(name).save_pretrained(tmp_path / "model")
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    return InprocServerProcess(cuts, optimizer="sgd", lr=LR, model=str(tmp_path / "model"), checkpoint_dir=tmp_path / "ck",
                               extra=["--token-file", str(tmp_path / "tokens"), *extra])


def member(tmp_path, srv, name):
    from splitlearn import AutoSplitModelForCausalLM

    return AutoSplitModelForCausalLM.from_pretrained(str(tmp_path / "model"), server=srv.url, token=TOKEN,
                                                     client_id=name).train()


def batch(rows, seed):
    """A left-padded batch with the stock collator's labels (the padding -100): a left-padded row's
    first real token is a target (predicted from the last pad's position), which the server's
    FedAvg weight must count (U-shape: the labels never reach it)."""
    ids, mask = fam.padded(batch=rows, seed=seed)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def sgd_step(model, opt, ids, mask, labels):
    """Positions given, from the mask (as generate() derives them): Gemma 2's eager attention
    backpropagates into q and k from a pad's query (its row wholly masked, the last pad's logits a
    target), so its gradients (not its loss) follow the positions a pad is given (docs/MODELS.md)."""
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def unsplit(tmp_path, batches):
    """The unsplit model after one SGD step on each batch in turn."""
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "model").train()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for ids, mask, labels in batches:
        sgd_step(ref, opt, ids, mask, labels)
    return ref.state_dict()


def assert_both_sides(expected, model, srv, initial):
    model.flush()
    sides = {"client": client_weights(model), "server": srv.weights()}
    for side, weights in sides.items():
        moved = 0.0
        for name, w in weights.items():
            assert torch.allclose(w, expected[name], rtol=0, atol=ATOL), (side, name, float((w - expected[name]).abs().max()))
            moved = max(moved, float((w - initial[name]).abs().max()))
        assert moved > 1e-3, f"{side} weights barely moved: the test proves nothing"
    assert set(expected) <= set(sides["client"]) | set(sides["server"]) | {"lm_head.weight"}  # nothing unchecked
    assert "model.layers.0.self_attn.q_proj.weight" in sides["client"]  # the family's names


@pytest.mark.parametrize("name, cuts", [(NAME, (1, 3)), (NAME, (2,)), ("gemma2", (1, 3))],
                         ids=["u", "2way", "gemma2-u"])
def test_a_splitfed_round_of_family_members_equals_one_unsplit_step(name, cuts, tmp_path):
    batches = [batch(2, 1), batch(3, 2)]
    with serve(tmp_path, cuts, "--federation", "splitfed", "--clients-per-round", "2",
               "--max-member-share", "1", name=name) as srv:
        initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
        models = [member(tmp_path, srv, n) for n in "ab"]
        opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]

        def one_round(i):
            return lambda: (sgd_step(models[i], opts[i], *batches[i]), models[i].sync())

        run_threads([one_round(0), one_round(1)])
        together = tuple(torch.cat([b[k] for b in batches]) for k in range(3))
        expected = unsplit(tmp_path, [together])
        for m in models:  # both continue from the average
            assert m.remote.federation.version == 1
            assert_both_sides(expected, m, srv, initial)
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        tokens = sum(int((b[2][:, 1:] != -100).sum()) for b in batches)
        assert status["last_round"]["members"] == 2 and status["last_round"]["samples"] == tokens
        for m in models:
            m.remote.close()


@pytest.mark.parametrize("name", [NAME, "gemma2"])
def test_sequential_turns_of_family_members_equal_the_unsplit_steps(name, tmp_path):
    """a trains two steps and syncs, then b (its first forward takes the turn and loads a's
    weights), then a again (the same, with b's)."""
    order = [("a", batch(2, 1)), ("a", batch(2, 2)), ("b", batch(3, 3)), ("a", batch(2, 4))]
    with serve(tmp_path, (1, 3), "--federation", "sequential", name=name) as srv:
        initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
        models = {n: member(tmp_path, srv, n) for n in "ab"}
        opts = {n: torch.optim.SGD(m.parameters(), lr=LR) for n, m in models.items()}
        prev = None
        for name, b in order:
            if prev is not None and prev != name:
                models[prev].sync()
            sgd_step(models[name], opts[name], *b)
            prev = name
        models[prev].sync()
        assert_both_sides(unsplit(tmp_path, [b for _, b in order]), models["a"], srv, initial)
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["version"] == 3 and status["turn"] is None
        for m in models.values():
            m.remote.close()


def test_a_splitfed_round_through_a_fed_server_of_its_own_equals_one_unsplit_step(tmp_path):
    """``--client-weights external``: the segment server answers syncs with signed tickets and the
    members' Llama weights go to ``python -m splitlearn.server.http.fedapp`` (its schema built from
    the same saved folder), two tenants; the round equals one unsplit step on their rows together."""
    from serverproc import OTHER, InprocFedServer

    secret = b"s" * 20 + b"3c9e1f7a5b2d4c6e8f0a1b2c"
    fed_tokens = {"alice": "fed-alice-0d8e7c6b5a4f", "mallory": "fed-mallory-1e9f8d7c6b"}
    (tmp_path / "secret").write_bytes(secret)
    (tmp_path / "fed-tokens").write_text("".join(f"{k} {v}\n" for k, v in fed_tokens.items()))
    seg = serve(tmp_path, (1, 3), "--federation", "splitfed", "--clients-per-round", "2", "--max-member-share", "1",
                "--client-weights", "external", "--fed-secret-file", str(tmp_path / "secret"))
    fed = InprocFedServer(["--model", str(tmp_path / "model"), "--cut", "1", "--cut", "3", "--mode", "splitfed",
                           "--max-member-share", "1", "--fed-secret-file", str(tmp_path / "secret"),
                           "--token-file", str(tmp_path / "fed-tokens")])
    from splitlearn import AutoSplitModelForCausalLM

    batches = [batch(2, 1), batch(3, 2)]
    with fed, seg:
        initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
        models = [AutoSplitModelForCausalLM.from_pretrained(str(tmp_path / "model"), server=seg.url, token=tok,
                                                            client_id=cid, fed_url=fed.url, fed_token=fed_tokens[who],
                                                            wait_timeout_s=120).train()
                  for tok, cid, who in ((TOKEN, "a", "alice"), (OTHER, "m", "mallory"))]
        opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
        run_threads([lambda i=i: (sgd_step(models[i], opts[i], *batches[i]), models[i].sync()) for i in range(2)])
        together = tuple(torch.cat([b[k] for b in batches]) for k in range(3))
        expected = unsplit(tmp_path, [together])
        for m in models:
            assert m.remote.federation.version == 1
            assert_both_sides(expected, m, seg, initial)
        assert web.get(seg.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=10).status_code == 404  # not there
        for m in models:
            m.remote.close()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ARGS = ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", ",".join(LORA_TARGETS)]


def lora_member(tmp_path, srv, name):
    from peft import LoraConfig

    from splitlearn import AutoSplitModelForCausalLM

    return AutoSplitModelForCausalLM.from_pretrained(
        str(tmp_path / "model"), server=srv.url, token=TOKEN, client_id=name,
        lora=LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)).train()


def peft_unsplit(tmp_path, batches):
    """Single-process peft on the stock class after one SGD step on each batch in turn, its adapters
    initialised as every federation member's (:func:`init_adapter_pair` seeded without a client id)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from splitlearn.model.lora import init_adapter_pair

    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "model"),
                         LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)).train()
    for name, m in ref.base_model.model.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            a, b = init_adapter_pair(0, "", name, m.in_features, m.out_features, 4)
            with torch.no_grad():
                m.lora_A["default"].weight.copy_(a)
                m.lora_B["default"].weight.copy_(b)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    for ids, mask, labels in batches:
        sgd_step(ref, opt, ids, mask, labels)
    return get_peft_model_state_dict(ref)


def assert_adapters(expected, model, srv, base):
    """Both sides' adapters (the server's: the shared one, read as the member's) equal ``expected``
    and moved; the server's base layers never trained."""
    from splitlearn.api.wire import decode
    from splitlearn.hf.lora import adapter_tensors

    model.flush()
    r = web.get(srv.url + P.CLIENT_ADAPTER.format(client_id=model.remote.client_id), headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    server_side = decode(r.content)[0]
    got = {**adapter_tensors(model), **server_side}
    assert set(got) == set(expected) and len(server_side) == 2 * 2 * len(LORA_TARGETS)  # 2 server layers, A and B
    for k, w in expected.items():
        assert torch.allclose(got[k], w, rtol=0, atol=ATOL), (k, float((got[k] - w).abs().max()))
    assert max(float(w.abs().max()) for k, w in expected.items() if "lora_B" in k) > 1e-3  # B moved from 0
    assert all(torch.equal(v, base[k]) for k, v in srv.weights().items())


def test_lora_in_a_splitfed_round_of_llama_members_equals_one_peft_step(tmp_path):
    """SplitLoRA: both members start from the same adapters; the round averages both sides'
    adapters by target tokens, which equals peft's single-process step on their rows together."""
    batches = [batch(2, 1), batch(3, 2)]
    with serve(tmp_path, (1, 3), "--federation", "splitfed", "--clients-per-round", "2",
               "--max-member-share", "1", *LORA_ARGS) as srv:
        base = srv.weights()
        models = [lora_member(tmp_path, srv, n) for n in "ab"]
        opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m in models]
        run_threads([lambda i=i: (sgd_step(models[i], opts[i], *batches[i]), models[i].sync()) for i in range(2)])
        expected = peft_unsplit(tmp_path, [tuple(torch.cat([b[k] for b in batches]) for k in range(3))])
        for m in models:
            assert m.remote.federation.version == 1
            assert_adapters(expected, m, srv, base)
        for m in models:
            m.remote.close()


def test_lora_in_sequential_turns_of_llama_members_equals_peft_steps_in_turn_order(tmp_path):
    order = [("a", batch(2, 1)), ("b", batch(3, 2)), ("a", batch(2, 3))]
    with serve(tmp_path, (1, 3), "--federation", "sequential", *LORA_ARGS) as srv:
        base = srv.weights()
        models = {n: lora_member(tmp_path, srv, n) for n in "ab"}
        opts = {n: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for n, m in models.items()}
        for name, b in order:
            sgd_step(models[name], opts[name], *b)
            models[name].sync()
        assert_adapters(peft_unsplit(tmp_path, [b for _, b in order]), models["a"], srv, base)
        for m in models.values():
            m.remote.close()
