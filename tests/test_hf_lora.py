"""Per-client LoRA on the split model classes (splitlearn/hf/lora.py) against a real
``python -m splitlearn.server --lora-r ...`` process: a plain PyTorch loop trains exactly as
single-process peft with the same adapter initialisation, on both sides of the cut; the
server's base weights never change; a model without LoRA is refused by a LoRA server."""
import pytest
import torch
from peft import get_peft_model_state_dict

from splitlearn.api import protocol as P
from splitlearn.errors import ConfigError
from splitlearn.hf import SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel
from splitlearn.api.wire import decode

from serverproc import TOKEN, InprocServerProcess, auth, same_weights, web
from test_client_lora import LORA_ARGS, peft_config, peft_model

pytestmark = pytest.mark.slow

LR = 0.05


def batches(n=3, rows=2, T=10):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (rows, T), generator=g) for _ in range(n)]


def sgd_losses(model, data) -> list[float]:
    """A plain loop: one SGD step per batch on the trainable parameters; the losses."""
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_lora_plain_loop_equals_peft(cuts, tmp_path):
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR, checkpoint_dir=tmp_path / "ckpt", extra=LORA_ARGS) as srv:
        base = srv.weights()
        with pytest.raises(ConfigError, match="LoRA"):  # a LoRA server refuses a model without adapters
            SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="bob")
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="alice",
                                                     lora=peft_config()).train()
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n or n.endswith("grad_proxy") for n in trainable)
        data = batches()
        losses = sgd_losses(model, data)
        ref = peft_model("alice")
        ref_losses = sgd_losses(ref, data)
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        want = get_peft_model_state_dict(ref)
        model.flush()  # the last step's apply rides on the next request: sent before reading the server
        r = web.get(srv.url + P.CLIENT_ADAPTER.format(client_id="alice"), headers=auth(), timeout=30)
        assert r.status_code == 200, r.text
        got = decode(r.content)[0]  # the server's adapter for alice, peft names
        for name, m in model.named_modules():
            if hasattr(m, "lora_A") and "default" in m.lora_A:
                for part in ("lora_A", "lora_B"):
                    got[f"base_model.model.{name}.{part}.weight"] = getattr(m, part)["default"].weight.detach()
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)
        assert same_weights(base, srv.weights())  # the server's base segment never trains
        model.remote.close()


def test_lora_classification_trains_its_head_and_adapters():
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR, extra=LORA_ARGS) as srv:
        model = SplitGPT2ForSequenceClassification.from_pretrained(
            "tiny", server=srv.url, token=TOKEN, client_id="carol", num_labels=2, pad_token_id=256,
            lora="server").train()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert "score.weight" in trainable and any("lora_A" in n for n in trainable)
        assert not any(n.startswith("transformer.wte") for n in trainable)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        head = model.score.weight.detach().clone()
        out = model(input_ids=batches(1)[0], labels=torch.tensor([0, 1]))
        out.loss.backward()
        opt.step()
        assert not torch.equal(head, model.score.weight)
        assert model.flush()["applied"]  # the deferred apply, sent on its own
        with pytest.raises(ConfigError, match="already"):
            from splitlearn.hf.lora import apply_lora
            apply_lora(model, "server")
        model.remote.close()
