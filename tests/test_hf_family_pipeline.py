"""Micro-batch pipelining (splitlearn/hf/pipeline.py) on any family's split class
(``AutoSplitModelForCausalLM``): a tiny Llama (GQA) and Gemma 2 against a real in-process server,
U-shape and 2-way. A pipelined training step equals the unsplit step (so the unpipelined one,
tests/test_hf_auto.py): the loss, every client gradient, and the server's weights after its apply."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM, ConfigError

from serverproc import TENANTS, TOKEN, InprocServerProcess

LR, M = 0.05, 2


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_a_pipelined_step_equals_the_unsplit_step(name, cuts, tmp_path):
    pipelined_step(name, cuts, tmp_path)


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_1f1b_with_the_loss_gradient_known_equals_the_unsplit_step(cuts, tmp_path):
    """``remote.loss_gradient = 1`` (what ``loss.backward()`` will send): each micro-batch's
    backward runs during the forward (2-way: one fused request per micro-batch)."""
    pipelined_step("llama-gqa", cuts, tmp_path, known=1.0)


def pipelined_step(name, cuts, tmp_path, known=None):
    fam.model(name).save_pretrained(tmp_path / "model")
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR, model=str(tmp_path / "model"), checkpoint_dir=tmp_path / "ck",
                             extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(tmp_path / "model"), server=srv.url, token=TOKEN,
                                                          micro_batches=M).train()
        model.choose_micro_batches = False
        assert model.micro_batches == M
        model.remote.loss_gradient = known
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "model").train()
        ids, mask = fam.padded(batch=3)  # micro-batches of 2 and 1 rows, the first left-padded
        labels = ids.masked_fill(mask == 0, -100)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        calls = model.remote.stats.calls
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)  # no positions: the stock class's own
        assert out.logits is None  # the micro-batches' logits are not kept (pipeline.py)
        assert out.loss.detach().item() == pytest.approx(float(want.loss.detach()), rel=1e-6)
        out.loss.backward()
        want.loss.backward()
        # a forward and a backward per micro-batch (2-way 1F1B: one fused step request each)
        assert model.remote.stats.calls - calls == (M if known and len(cuts) == 1 else 2 * M)
        grads, tied = dict(ref.named_parameters()), set()
        if len(cuts) == 1 and ref.config.tie_word_embeddings:  # 2-way: the server's head is its own copy
            tied = {"model.embed_tokens.weight", "lm_head.weight"}
        checked = 0
        for n, p in model.named_parameters():
            if n in grads and n not in tied:
                err = float((p.grad - grads[n].grad).abs().max()) / float(grads[n].grad.abs().max())
                assert err < 1e-5, (n, err)
                checked += 1
        assert checked > 5
        before = srv.weights()
        opt.step()
        ref_opt.step()
        model.flush()
        server, expected = srv.weights(), ref.state_dict()
        moved = 0.0
        for k, w in server.items():
            if k not in tied:
                assert torch.allclose(w, expected[k], rtol=0, atol=1e-6), k
                moved = max(moved, float((w - before[k]).abs().max()))
        assert moved > 1e-3  # the server's step happened: the comparison can fail
        model.remote.close()


def test_bad_micro_batches_are_refused(tmp_path):
    fam.model("llama-gqa").save_pretrained(tmp_path / "model")
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), model=str(tmp_path / "model"),
                             extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(tmp_path / "model"), server=srv.url, token=TOKEN)
        for bad in (0, True, "2"):
            with pytest.raises(ConfigError, match="micro_batches"):
                model.micro_batches = bad
        model.remote.close()
