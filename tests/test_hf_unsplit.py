"""The whole model out of a split one (issue 51, item 3), against a real server in this process:
``merge_and_unload`` gives the plain transformers model with the server's weights as trained
(and both sides' LoRA merged); saved and reloaded by ``AutoModelForCausalLM`` it gives the split
model's logits; a server of several tenants refuses its weights unless its operator allows it,
and a tenant reads only its own adapter; a split model's own folder loads back as the split model
and is refused by ``AutoModelForCausalLM``, never loaded with random blocks."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2ForSequenceClassification, GPT2LMHeadModel

from splitlearn.api import protocol as P
from splitlearn.api.wire import decode
from splitlearn.errors import ConfigError, Forbidden
from splitlearn.hf import SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, web
from test_client_lora import LORA_ARGS, peft_config

pytestmark = pytest.mark.slow


def batch(seed: int = 0, rows: int = 2, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, T), generator=g)
    mask = torch.ones(rows, T, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    return ids.masked_fill(mask == 0, 256), mask


def train(model, steps: int = 3, lr: float = 0.05):
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for i in range(steps):
        ids, mask = batch(i)
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_merge_and_unload_is_the_trained_model_whole(cuts, tmp_path):
    with InprocServerProcess(cuts, optimizer="sgd", lr=0.05, checkpoint_dir=tmp_path / "ckpt") as srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="alice")
        before = {k: v.clone() for k, v in srv.weights().items()}
        train(model)  # the last step's apply still deferred: merge_and_unload sends it first
        unsplit = model.merge_and_unload()
        assert type(unsplit) is GPT2LMHeadModel
        server_now = srv.weights()
        assert any(not torch.equal(before[k], server_now[k]) for k in server_now)  # trained
        sd = unsplit.state_dict()
        for k, v in server_now.items():  # the server's weights as trained, not those at load
            assert torch.equal(sd[k], v), k
        assert not any(k.startswith("splitlearn") for k in unsplit.config.to_dict())
        ids, mask = batch(9)
        want = logits(model, ids, mask)
        torch.testing.assert_close(logits(unsplit, ids, mask), want, atol=2e-5, rtol=1e-4)
        unsplit.save_pretrained(tmp_path / "whole")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
        assert type(again) is GPT2LMHeadModel
        torch.testing.assert_close(logits(again, ids, mask), want, atol=2e-5, rtol=1e-4)
        assert again.config.tie_word_embeddings == (len(cuts) == 2)  # 2-way: the server's head is its own
        model.remote.close()


def test_a_split_folder_loads_back_split_and_auto_refuses_it(tmp_path):
    with InprocServerProcess((1, 3), optimizer="sgd", lr=0.05, checkpoint_dir=tmp_path / "ckpt") as srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="alice")
        train(model)
        model.save_pretrained(tmp_path / "split")
        cfg = json.loads((tmp_path / "split" / "config.json").read_text())
        assert cfg["model_type"] == "splitlearn-split-client" and cfg["splitlearn"]["model_type"] == "gpt2"
        with pytest.raises(ConfigError, match="client side only(.|\n)*merge_and_unload"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "split")
        with pytest.raises(OSError, match="model.safetensors"):  # the plain class finds no weights: never random blocks
            GPT2LMHeadModel.from_pretrained(tmp_path / "split")
        ids, mask = batch(9)
        want = logits(model, ids, mask)
        back = SplitGPT2LMHeadModel.from_pretrained(tmp_path / "split", server=srv.url, token=TOKEN, client_id="bob")
        torch.testing.assert_close(logits(back, ids, mask), want, atol=0, rtol=0)  # client weights as trained
        model.remote.close()
        back.remote.close()


def test_a_server_of_several_tenants_exports_only_where_allowed(tmp_path):
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    extra = ["--token-file", str(tmp_path / "tokens")]
    with InprocServerProcess((1, 3), extra=extra) as srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=OTHER, client_id="m")
        with pytest.raises(Forbidden, match="--allow-weight-export"):
            model.merge_and_unload()
        r = web.get(srv.url + P.CLIENT_WEIGHTS.format(client_id="m"), headers=auth(OTHER), timeout=30)
        assert r.status_code == 403 and r.json()["error"] == "forbidden" and "--allow-weight-export" in r.text
        r = web.get(srv.url + P.CLIENT_WEIGHTS.format(client_id="m"), headers=auth(TOKEN), timeout=30)
        assert r.status_code == 200  # the operator's token may
        you = lambda tok: web.get(srv.url + P.INFO, headers=auth(tok), timeout=30).json()["you"]["weight_export"]  # noqa: E731
        assert you(OTHER) is False and you(TOKEN) is True  # /v1/info tells a client before it trains
        model.remote.close()
    with InprocServerProcess((1, 3), extra=extra + ["--allow-weight-export"]) as srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=OTHER, client_id="m")
        assert type(model.merge_and_unload()) is GPT2LMHeadModel
        model.remote.close()
    with InprocServerProcess((1, 3), extra=["--allow-weight-export", "no"]) as srv:  # one tenant, refused
        r = web.get(srv.url + P.CLIENT_WEIGHTS.format(client_id="m"), headers=auth(TOKEN), timeout=30)
        assert r.status_code == 403


def test_lora_merged_from_both_sides_and_each_tenant_reads_its_own(tmp_path):
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    extra = LORA_ARGS + ["--token-file", str(tmp_path / "tokens"), "--allow-weight-export"]
    with InprocServerProcess((1, 3), optimizer="sgd", lr=0.05, checkpoint_dir=tmp_path / "ckpt", extra=extra) as srv:
        base = srv.weights()
        alice = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="alice",
                                                     lora=peft_config())
        train(alice)
        mallory = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=OTHER, client_id="alice",
                                                       lora=peft_config())
        r = web.get(srv.url + P.CLIENT_WEIGHTS.format(client_id="alice"), headers=auth(OTHER), timeout=30)
        tensors, meta = decode(r.content)
        assert r.status_code == 200 and not any("lora_" in k for k in tensors)  # its own "alice": none yet
        assert all(torch.equal(tensors[k], base[k]) for k in base)
        assert meta["steps_applied"] == "0"  # its own steps, not alice's (tenants see their own)
        unsplit = alice.merge_and_unload()
        assert type(unsplit) is GPT2LMHeadModel and not any("lora" in k for k in unsplit.state_dict())
        ids, mask = batch(9)
        want = logits(alice, ids, mask)
        server_part = {k: v for k, v in unsplit.state_dict().items() if k in base}
        assert any(not torch.equal(server_part[k], base[k]) for k in server_part)  # the server adapter merged
        torch.testing.assert_close(logits(unsplit, ids, mask), want, atol=2e-5, rtol=1e-4)
        unsplit.save_pretrained(tmp_path / "whole")
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "whole"), ids, mask),
                                   want, atol=2e-5, rtol=1e-4)
        alice.remote.close()
        mallory.remote.close()


def test_another_head_unsplits_to_its_own_class(tmp_path):
    with InprocServerProcess((1, 3)) as srv:
        model = SplitGPT2ForSequenceClassification.from_pretrained("tiny", server=srv.url, token=TOKEN, num_labels=3)
        unsplit = model.merge_and_unload()
        assert type(unsplit) is GPT2ForSequenceClassification
        ids, mask = batch(9)
        torch.testing.assert_close(logits(unsplit, ids, mask), logits(model, ids, mask), atol=2e-5, rtol=1e-4)
        model.remote.close()


def served(srv):
    from splitlearn.server.http.routing import SERVED

    return srv.app.extensions[SERVED]


def test_train_export_merged_is_refused_before_any_step_where_the_server_does_not_export(tmp_path, monkeypatch,
                                                                                          capsys):
    """``train --export-merged DIR`` against a server of two tenants started without
    ``--allow-weight-export`` (issue 51): the tenant's run ends before its first step with the
    server's reason, nothing trained on the server, no folder written; the operator's passes."""
    from splitlearn.client.cli import main

    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), checkpoint_dir=tmp_path / "ckpt",
                             extra=["--token-file", str(tmp_path / "tokens")]) as srv:
        before = srv.weights()
        argv = ["train", "--server", srv.url, "--model", "tiny", "--device", "cpu", "--steps", "2", "--batch-size",
                "2", "--seq-len", "8", "--quiet", "--client-id", "m", "--export-merged", str(tmp_path / "whole")]
        monkeypatch.setenv("SPLITLEARN_TOKEN", OTHER)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--export-merged" in err and "--allow-weight-export" in err and "nothing was trained" in err, err
        after = srv.weights()
        assert all(torch.equal(after[k], before[k]) for k in before)  # not one step applied
        assert web.get(srv.url + P.INFO, headers=auth(OTHER), timeout=30).json()["steps_applied"] == 0
        assert not (tmp_path / "whole").exists()
        monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)  # the operator may: trains, then exports
        assert main(argv) == 0
        assert (tmp_path / "whole" / "config.json").exists()
        assert any(not torch.equal(srv.weights()[k], before[k]) for k in before)


def test_the_weights_answer_is_counted_in_the_memory_budget(tmp_path):
    """``GET /v1/clients/<id>/weights`` prices its answer (a host copy and the encoded bytes of
    the segment) like any route: past the per-request limit 413 naming the flag; where the memory
    account has less room left than that (other requests' holds), 503; then, with room, 200. (The
    tiny model's ~0.1 MiB is below the flags' 1 MiB minimum: the live limits are set instead.)"""
    url = P.CLIENT_WEIGHTS.format(client_id="a")
    with InprocServerProcess((1, 3), extra=["--allow-weight-export"]) as srv:
        r = web.get(srv.url + url, headers=auth(TOKEN), timeout=30)
        assert r.status_code == 200
        size = sum(t.numel() * t.element_size() for t in decode(r.content)[0].values())
        s = served(srv)
        limit, s.rt.budget.limit = s.rt.budget.limit, 2 * size - 1
        r = web.get(srv.url + url, headers=auth(TOKEN), timeout=30)
        assert r.status_code == 413 and "--max-request-memory-gb" in r.json()["message"], r.text
        s.rt.budget.limit = limit
        other = s.memory.reserve("", s.memory.limit - s.memory.reserved - size, "another request")  # room: size
        r = web.get(srv.url + url, headers=auth(TOKEN), timeout=30)
        assert r.status_code == 503 and "--max-memory-gb" in r.json()["message"], r.text
        s.memory.release(other)
        assert s.memory.reserved == 0  # the refused answers' reservations went with them
        assert web.get(srv.url + url, headers=auth(TOKEN), timeout=30).status_code == 200


def test_a_splitfed_member_gets_its_own_copy_not_the_base(tmp_path):
    """In SplitFed a round's member trains a copy of the segment; its ``GET weights`` gives that
    copy (what ``merge_and_unload`` must merge), not the base the round started from; after the
    round closes, the base (now the average)."""
    from splitlearn.client import SplitClient

    with InprocServerProcess((1, 3), optimizer="sgd", lr=0.05, checkpoint_dir=tmp_path / "ckpt", extra=[
            "--federation", "splitfed", "--clients-per-round", "2", "--allow-weight-export"]) as srv:
        base = srv.weights()
        with SplitClient(srv.url, "tiny", token=TOKEN, optimizer="sgd", lr=0.05, device="cpu", client_id="a") as a:
            for seed in range(2):
                a.train_step(torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed)))
            got = lambda cid: decode(web.get(srv.url + P.CLIENT_WEIGHTS.format(client_id=cid),  # noqa: E731
                                             headers=auth(TOKEN), timeout=30).content)[0]
            mine, other = got("a"), got("b")
            assert any(not torch.equal(mine[k], base[k]) for k in base)  # a trained: its copy moved
            assert all(torch.equal(other[k], base[k]) for k in base)  # b is no member: the base
            (copy,) = served(srv).rt.federation.round.members.values()  # a's, the one member
            member = copy.segment.hf_state_dict()
            assert mine.keys() == member.keys()
            assert all(torch.equal(mine[k], member[k].cpu()) for k in member)  # its own copy, exactly
