"""Per-client LoRA against a real ``python -m splitlearn.server --lora-r ...`` process.

Exactness is against single-process peft (``get_peft_model`` on the unsplit tiny GPT-2) with
the same adapter initialisation (:func:`splitlearn.model.lora.init_adapter_pair`), the same data and
optimizer: losses, and every adapter weight on both sides. Server weights are read from the
checkpoint it writes on ``POST /v1/checkpoint``.
"""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from splitlearn import load_model
from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.hf.lora import adapter_tensors
from splitlearn.errors import ConfigError
from splitlearn.model.lora import LoraSpec, init_adapter_pair
from splitlearn.model.segments import labels_from_batch
from splitlearn.model.segments import labels_from_batch, positions_from_mask
from splitlearn.api.wire import decode

from serverproc import OTHER, TOKEN, InprocServerProcess, auth, run_threads, same_weights, web
from test_client import BATCHES, LR, train_whole

pytestmark = pytest.mark.slow

SPEC = LoraSpec(r=4, alpha=8.0, targets=("c_attn", "c_proj"))
LORA_ARGS = ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "c_attn,c_proj"]
ATOL = 1e-5


def peft_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)


def lora_server(cuts, optimizer="sgd", tmp_path=None, extra=()):
    return InprocServerProcess(cuts, optimizer=optimizer, lr=LR[optimizer], checkpoint_dir=tmp_path,
                               extra=LORA_ARGS + list(extra))


def lora_client(srv, name, optimizer="sgd", token=TOKEN) -> SplitClient:
    return SplitClient(srv.url, "tiny", token=token, optimizer=optimizer, lr=LR[optimizer], device="cpu",
                       client_id=name, lora=peft_config())


def peft_model(init_id: str):
    """Single-process peft on the whole tiny GPT-2, adapters initialised as a split run's."""
    model = get_peft_model(load_model("tiny"), SPEC.to_peft())
    for name, m in model.base_model.model.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            a, b = init_adapter_pair(0, init_id, name, m.in_features, m.out_features, SPEC.r)
            with torch.no_grad():
                m.lora_A["default"].weight.copy_(a)
                m.lora_B["default"].weight.copy_(b)
    return model


def peft_reference(client_id: str, optimizer: str, batches, init_id=None):
    model = peft_model(client_id if init_id is None else init_id)
    return model, train_whole(model, [p for p in model.parameters() if p.requires_grad], optimizer, batches)


def server_adapter(srv, client_id, token=TOKEN):
    r = web.get(srv.url + P.CLIENT_ADAPTER.format(client_id=client_id), headers=auth(token), timeout=30)
    return r


def both_sides(client, srv) -> dict:
    client.flush()  # the last step's apply rides on the next request: sent before reading the server
    r = server_adapter(srv, client.client_id)
    assert r.status_code == 200, r.text
    return {**adapter_tensors(client.model), **decode(r.content)[0]}


def assert_adapters_equal(got: dict, ref_model):
    ref = get_peft_model_state_dict(ref_model)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=ATOL, rtol=0, msg=k)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_split_lora_training_equals_peft_and_the_export_is_that_peft_model(cuts, optimizer, tmp_path):
    ckpt = tmp_path / "ckpt"
    with lora_server(cuts, optimizer, ckpt) as srv:
        base_before = srv.weights()
        client = lora_client(srv, "alice", optimizer)
        losses = [client.train_step(*b) for b in BATCHES]
        ref, ref_losses = peft_reference("alice", optimizer, BATCHES)
        assert losses == pytest.approx(ref_losses, abs=ATOL)
        assert_adapters_equal(both_sides(client, srv), ref)
        assert same_weights(base_before, srv.weights())  # the base never changes
        # only adapters train on the client too
        trained = {id(p) for g in client.optimizer.param_groups for p in g["params"]}
        assert all(("lora_" in n) == (id(p) in trained) for s in client.segments for n, p in s.named_parameters())

        out = client.export_adapter(tmp_path / "adapter")
        assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
        loaded = PeftModel.from_pretrained(load_model("tiny"), str(out)).eval()
        ids, mask = BATCHES[1]
        pos = positions_from_mask(mask, ids.shape[1])
        with torch.no_grad():
            want = ref.eval()(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            got = loaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert client.evaluate(ids, mask) == pytest.approx(
            float(loaded(input_ids=ids, attention_mask=mask, position_ids=pos,
                         labels=labels_from_batch(ids, mask)).loss), abs=1e-5)
        assert set(load_file(str(out / "adapter_model.safetensors"))) == set(get_peft_model_state_dict(ref))
        if optimizer == "adamw" and len(cuts) == 2:  # checkpointed adapters + AdamW state survive a restart
            before = decode(server_adapter(srv, "alice").content)[0]
            srv.restart()
            after = decode(server_adapter(srv, "alice").content)[0]
            assert same_weights(before, after)
            extra = BATCHES[0]
            loss = client.train_step(*extra)
            ref2, ref_losses2 = peft_reference("alice", optimizer, BATCHES + [extra])
            assert loss == pytest.approx(ref_losses2[-1], abs=ATOL)
            assert_adapters_equal(both_sides(client, srv), ref2)
        client.close()


def test_concurrent_clients_are_isolated_and_a_token_reads_only_its_own_adapter(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN} operator\nmallory {OTHER}\n")
    data = {"a": BATCHES[:3], "b": [BATCHES[3], BATCHES[1], BATCHES[0]], "c": BATCHES[2:]}
    with lora_server((1, 3), "adamw", tmp_path / "ckpt", extra=["--token-file", str(tokens), "--threads", "4"]) as srv:
        base_before = srv.weights()
        clients = {n: lora_client(srv, n, "adamw", token=OTHER if n == "c" else TOKEN) for n in data}
        probe = BATCHES[0]
        c_before = clients["c"].evaluate(*probe)

        def train(name):
            for b in data[name]:
                clients[name].train_step(*b)

        run_threads([lambda n=n: train(n) for n in ("a", "b")], 120)
        # each concurrent client equals its own single-process run: the others changed nothing of it
        for n in ("a", "b"):
            ref, _ = peft_reference(n, "adamw", data[n])
            assert_adapters_equal(both_sides(clients[n], srv), ref)
        assert clients["c"].evaluate(*probe) == c_before  # an untrained client still sees the base
        assert same_weights(base_before, srv.weights())
        # another tenant's "a" is its own client: it cannot read alice's "a", and training
        # as "a" trains its own adapter, never hers
        assert server_adapter(srv, "a", token=OTHER).status_code == 404
        assert server_adapter(srv, "nobody").status_code == 404
        intruder = lora_client(srv, "a", "adamw", token=OTHER)
        intruder.train_step(*probe)
        assert intruder.step == 1 and server_adapter(srv, "a", token=OTHER).status_code == 200
        intruder.generate(probe[0][:1, :4], max_new_tokens=2)
        ref, _ = peft_reference("a", "adamw", data["a"])
        assert_adapters_equal(both_sides(clients["a"], srv), ref)  # unchanged by the other tenant
        for c in list(clients.values()) + [intruder]:
            c.close()


def test_mixed_adapter_sessions_generate_what_each_exported_model_generates(tmp_path):
    """Three clients with three adapters (and one untrained) decode at once through the batcher."""
    with lora_server((1, 3), "sgd", extra=["--threads", "6"]) as srv:
        names = ["a", "b", "c", "d"]
        clients = {n: lora_client(srv, n) for n in names}
        g = torch.Generator().manual_seed(1)
        texts = {n: torch.randint(0, 256, (2, 12), generator=g) for n in names}
        for n in names[:3]:  # each learns its own text, so greedy decoding tells the adapters apart
            for _ in range(5):
                clients[n].train_step(texts[n])
        prompts = {n: texts[n][:, :5] for n in names}
        got = {}

        def gen(n):
            got[n] = clients[n].generate(prompts[n], max_new_tokens=8)

        run_threads([lambda n=n: gen(n) for n in names], 120)
        base = load_model("tiny").eval()
        for n in names:
            ones = torch.ones_like(prompts[n])
            plain = base.generate(prompts[n], attention_mask=ones, max_new_tokens=8, do_sample=False, pad_token_id=0)
            if n == "d":  # no adapter trained yet: the base model
                assert torch.equal(got[n], plain)
                continue
            ref = PeftModel.from_pretrained(load_model("tiny"), str(clients[n].export_adapter(tmp_path / n))).eval()
            want = ref.generate(input_ids=prompts[n], attention_mask=ones, max_new_tokens=8, do_sample=False,
                                pad_token_id=0)
            assert torch.equal(got[n], want), n
            assert not torch.equal(got[n], plain), n  # the adapter changed what is generated
        for c in clients.values():
            c.close()


def test_lora_and_plain_clients_and_servers_refuse_each_other_at_connect():
    with InprocServerProcess((2,)) as plain:
        with pytest.raises(ConfigError, match="without --lora-r"):
            lora_client(plain, "x")
        r = web.get(plain.url + P.CLIENT_ADAPTER.format(client_id="x"), headers=auth(), timeout=10)
        assert r.status_code == 404
    with lora_server((2,)) as srv:
        with pytest.raises(ConfigError, match="LoRA"):
            SplitClient(srv.url, "tiny", token=TOKEN, device="cpu")
        with pytest.raises(ConfigError, match="differ"):
            SplitClient(srv.url, "tiny", token=TOKEN, device="cpu",
                        lora=LoraConfig(r=8, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
        assert web.get(srv.url + P.INFO, headers=auth(), timeout=10).json()["lora"] == SPEC.to_dict()


def test_splitfed_averages_both_sides_adapters_and_nothing_else(tmp_path):
    """SplitLoRA: two members train copies of the round's adapter; the round averages the server
    adapters and the client adapters by target tokens trained (each row's real positions after its
    position 0, a left-padded row's first real token a target: 42 and 18 here); the base never
    changes on either side. Uncapped (--max-member-share 1:
    the default 0.5 would weigh this round 1:1)."""
    data = {"a": BATCHES[:2], "b": BATCHES[2:3]}  # 4 and 2 samples
    with lora_server((1, 3), "sgd", tmp_path / "ckpt",
                     extra=["--federation", "splitfed", "--max-member-share", "1"]) as srv:
        base_before = srv.weights()
        clients = {n: lora_client(srv, n) for n in data}
        client_base = {n: {k: v.clone() for s in c.segments for k, v in s.state_dict().items() if "lora_" not in k}
                       for n, c in clients.items()}
        def member(n):
            for b in data[n]:
                clients[n].train_step(*b)
            clients[n].sync()

        run_threads([lambda n=n: member(n) for n in data], 120)
        refs = {n: get_peft_model_state_dict(peft_reference(n, "sgd", data[n], init_id="")[0]) for n in data}
        w = {n: sum(int((labels_from_batch(ids, m)[:, 1:] != -100).sum()) for ids, m in data[n]) for n in data}
        assert w == {"a": 42, "b": 18}
        want = {k: (refs["a"][k] * w["a"] + refs["b"][k] * w["b"]) / (w["a"] + w["b"]) for k in refs["a"]}
        for n, c in clients.items():
            got = both_sides(c, srv)  # in splitfed the server side is the round's average
            assert set(got) == set(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=0, msg=k)
            assert same_weights(client_base[n], {k: v for s in c.segments for k, v in s.state_dict().items()
                                                 if "lora_" not in k})
        assert same_weights(base_before, srv.weights())
        for c in clients.values():
            c.close()
