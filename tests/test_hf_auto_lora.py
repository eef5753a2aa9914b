"""Per-client LoRA on the other families (docs/MODELS.md): a server started with ``--lora-r`` on a
tiny Llama (GQA) or Gemma 2 folder, targets the family's linear layers (q/k/v/o, gate/up/down),
and ``AutoSplitModelForCausalLM.from_pretrained(dir, lora=peft.LoraConfig(...))``, U-shape and
2-way:

* a plain SGD loop trains exactly as single-process peft on the stock class with the same
  adapter initialisation (:func:`splitlearn.model.lora.init_adapter_pair`): every loss, and every
  adapter weight on both sides (the server's read back with ``GET /v1/clients/<id>/adapter``);
  the server's base weights never change;
* :func:`splitlearn.hf.lora.export_adapter` writes both sides' adapters as one peft directory that
  ``PeftModel.from_pretrained(<stock class>.from_pretrained(dir), adapter)`` loads with logits
  equal to the split model's; generate() through the server's session (this client's adapter)
  gives the peft model's tokens;
* a model without LoRA is refused by the LoRA server, and GPT-2's Conv1D names are refused for
  a Llama (naming the modules it has); ``--lora-r`` alone adapts peft's default for the family.
"""
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM, ConfigError
from splitlearn.api import protocol as P
from splitlearn.api.wire import decode
from splitlearn.hf.lora import adapter_tensors, export_adapter
from splitlearn.model.lora import LoraSpec, init_adapter_pair

from serverproc import TOKEN, InprocServerProcess, auth, same_weights, web

pytestmark = pytest.mark.slow

LR = 0.05
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARGS = ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", ",".join(TARGETS)]


def config():
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)


def peft_reference(folder, client_id):
    """Single-process peft on the stock class, adapters initialised as a split run's."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), config())
    for name, m in model.base_model.model.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            a, b = init_adapter_pair(0, client_id, name, m.in_features, m.out_features, 4)
            with torch.no_grad():
                m.lora_A["default"].weight.copy_(a)
                m.lora_B["default"].weight.copy_(b)
    return model


def sgd(model, steps=3):
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ids, mask = fam.padded()
    labels = ids.masked_fill(mask == 0, -100)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate()'s rule, as the split model's
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_lora_trains_as_peft_and_its_export_loads_on_the_stock_class(name, cuts, tmp_path):
    folder = tmp_path / "model"
    fam.model(name).save_pretrained(folder)
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR, checkpoint_dir=tmp_path / "ckpt", model=str(folder),
                             extra=ARGS) as srv:
        base = srv.weights()
        with pytest.raises(ConfigError, match="LoRA"):  # a LoRA server refuses a model without adapters
            AutoSplitModelForCausalLM.from_pretrained(str(folder), server=srv.url, token=TOKEN, client_id="bob")
        model = AutoSplitModelForCausalLM.from_pretrained(str(folder), server=srv.url, token=TOKEN,
                                                          client_id="alice", lora=config())
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert any(".mlp.down_proj.lora_B" in n for n in trainable)
        assert all("lora_" in n or n.endswith("grad_proxy") for n in trainable)
        losses = sgd(model)
        ref = peft_reference(folder, "alice")
        assert losses == pytest.approx(sgd(ref), abs=1e-5) and losses[-1] < losses[0]
        model.remote.flush()  # the last step's apply, before the server's adapter is read
        r = web.get(srv.url + P.CLIENT_ADAPTER.format(client_id="alice"), headers=auth(), timeout=30)
        assert r.status_code == 200, r.text
        server_side = decode(r.content)[0]  # the server's adapter for alice, peft's names
        got = {**server_side, **adapter_tensors(model)}
        want = get_peft_model_state_dict(ref)
        assert set(got) == set(want) and len(server_side) == 2 * 2 * len(TARGETS)  # 2 server layers, A and B
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)
        assert same_weights(base, srv.weights())  # the server's base layers never train

        out = export_adapter(model, tmp_path / "adapter", base_model=str(folder))
        assert json.loads((out / "adapter_config.json").read_text())["fan_in_fan_out"] is False  # nn.Linear
        stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(out)).eval()
        model.eval()
        ids, mask = fam.padded()
        with torch.no_grad():  # no positions on either side: the stock class's own
            got_logits = model(input_ids=ids, attention_mask=mask).logits
            want_logits = stock(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                  pad_token_id=fam.PAD)
        assert torch.equal(model.generate(**kw), stock.generate(**kw))  # the session runs alice's adapter
        model.remote.close()


def test_the_spec_takes_one_familys_names():
    assert LoraSpec(4, 8.0, ("q_proj", "down_proj")).to_peft().fan_in_fan_out is False
    assert LoraSpec(4, 8.0, ("c_attn",)).to_peft().fan_in_fan_out is True  # GPT-2's Conv1D
    with pytest.raises(ConfigError, match="not module names"):
        LoraSpec(4, 8.0, ("q_proj", "self_attn.q_proj"))


def test_a_llama_server_refuses_gpt2_targets(tmp_path):
    """A target the model lacks is refused at start, naming the linear modules its layers have."""
    folder = tmp_path / "model"
    fam.model("llama-gqa").save_pretrained(folder)
    for targets in ("c_attn", "c_attn,q_proj"):  # a mix of GPT-2's names and Llama's too
        with pytest.raises(ConfigError, match="no LoRA target module 'c_attn'.* down_proj, gate_proj, k_proj, "
                                              "o_proj, q_proj, up_proj, v_proj"):
            InprocServerProcess((1, 3), model=str(folder), extra=["--lora-r", "4", "--lora-targets", targets]).start()


def test_lora_r_alone_targets_the_familys_attention_as_peft(tmp_path):
    """``--lora-r`` alone on a Llama server adapts peft's default for the family (q_proj, v_proj:
    ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), said in /v1/info; a client's
    ``LoraConfig`` without ``target_modules`` (peft's own default) is the same spec, and two SGD
    steps equal single-process peft's on the stock class with peft's default targets."""
    folder = tmp_path / "model"
    fam.model("llama-gqa").save_pretrained(folder)
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR, model=str(folder),
                             extra=["--lora-r", "4", "--lora-alpha", "8"]) as srv:
        info = web.get(srv.url + P.INFO, headers=auth(), timeout=30).json()
        assert info["lora"]["targets"] == ["q_proj", "v_proj"]
        model = AutoSplitModelForCausalLM.from_pretrained(str(folder), server=srv.url, token=TOKEN,
                                                          client_id="alice", lora=LoraConfig(r=4, lora_alpha=8))
        assert model.lora_spec.targets == ("q_proj", "v_proj")
        ref = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(r=4, lora_alpha=8))
        names = set()
        for n, m in ref.base_model.model.named_modules():
            if hasattr(m, "lora_A") and "default" in m.lora_A:
                names.add(n.rsplit(".", 1)[-1])
                a, b = init_adapter_pair(0, "alice", n, m.in_features, m.out_features, 4)
                with torch.no_grad():
                    m.lora_A["default"].weight.copy_(a)
                    m.lora_B["default"].weight.copy_(b)
        assert names == {"q_proj", "v_proj"}  # peft's own choice
        losses = sgd(model, steps=2)
        assert losses == pytest.approx(sgd(ref, steps=2), abs=1e-5) and losses[1] != losses[0]
        model.remote.close()


@pytest.mark.parametrize("name", ["phi3", "gpt_neox", "opt", "falcon"])
def test_lora_on_families_with_other_linear_names(name, tmp_path):
    """Phi-3's fused qkv_proj/gate_up_proj, GPT-NeoX's and Falcon's query_key_value/dense/
    dense_h_to_4h/dense_4h_to_h, OPT's q/k/v/out_proj and fc1/fc2 (U-shape, lighter): two SGD
    steps equal single-process peft's losses, and the export on the stock class gives the split
    model's logits."""
    folder = tmp_path / "model"
    ref_model = fam.model(name)
    ref_model.save_pretrained(folder)
    targets = sorted({k.rsplit(".", 1)[-1] for k, m in ref_model.named_modules()
                      if isinstance(m, torch.nn.Linear) and not k.endswith("lm_head")})
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR, model=str(folder),
                             extra=["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", ",".join(targets)]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(folder), server=srv.url, token=TOKEN,
                                                          client_id="alice", lora=cfg)
        ref = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(r=4, lora_alpha=8,
                                                                                      target_modules=targets))
        for n, m in ref.base_model.model.named_modules():
            if hasattr(m, "lora_A") and "default" in m.lora_A:
                a, b = init_adapter_pair(0, "alice", n, m.in_features, m.out_features, 4)
                with torch.no_grad():
                    m.lora_A["default"].weight.copy_(a)
                    m.lora_B["default"].weight.copy_(b)
        losses = sgd(model, steps=2)
        assert losses == pytest.approx(sgd(ref, steps=2), abs=1e-5) and losses[1] != losses[0]
        out = export_adapter(model, tmp_path / "adapter", base_model=str(folder))
        stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(out)).eval()
        model.eval()
        ids, mask = fam.padded()
        with torch.no_grad():  # no positions on either side: the stock class's own (OPT's from the mask)
            got = model(input_ids=ids, attention_mask=mask).logits
            want = stock(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        model.remote.close()
