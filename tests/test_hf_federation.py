"""The federation modes on the model classes (splitlearn/hf/federation.py), real server processes.

A SplitFed round of two model-class members equals one unsplit SGD step on their rows
together, like SplitClient's (test_federation.py); sequential turns in a plain loop equal the
unsplit steps in turn order, the stale weights and the lapsed turn handled by the model.
"""
import types

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.errors import ConfigError
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.hf.federation import client_weights

from serverproc import TOKEN, InprocServerProcess, auth, run_threads, web
from test_client import BATCHES, LR, assert_both_sides_equal, unsplit_steps
from test_federation import same_batch

pytestmark = pytest.mark.slow


def member(srv, name) -> SplitGPT2LMHeadModel:
    return SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id=name).train()


def sgd_step(model, opt, ids, mask):
    pos = None if mask is None else mask.long().cumsum(-1).sub(1).clamp(min=0)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def as_client(model):
    """What test_client's assert_both_sides_equal reads: the client's weights by HF name."""
    weights = dict(client_weights(model))
    if model.lm_head is not None:  # U-shape: the tied head, under its own name as well
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    return types.SimpleNamespace(flush=model.flush, segments=[types.SimpleNamespace(hf_state_dict=lambda: weights)])


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_a_splitfed_round_of_model_classes_equals_one_unsplit_step(cuts, tmp_path):
    # 2 rows, one left-padded by 3 (its first real token a target, as the stock loss counts it), and 4 full rows
    batches = [BATCHES[1], (torch.cat([same_batch(11)[0], same_batch(12)[0]]), None)]
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,  # 2 vs 4 rows: no share cap
                             extra=["--federation", "splitfed", "--clients-per-round", "2", "--max-member-share", "1"]) as srv:
        models = [member(srv, n) for n in "ab"]
        opts = [torch.optim.SGD(m.parameters(), lr=LR["sgd"]) for m in models]

        def one_round(i):
            return lambda: (sgd_step(models[i], opts[i], *batches[i]), models[i].sync())

        run_threads([one_round(0), one_round(1)])
        union_mask = torch.cat([batches[0][1], torch.ones_like(batches[1][0])])
        reference, _ = unsplit_steps(cuts, "sgd", [(torch.cat([b[0] for b in batches]), union_mask)])
        for m in models:  # both continue from the average
            assert m.remote.federation.version == 1
            assert_both_sides_equal(reference, as_client(m), srv)
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        # target tokens: 11 and 9 (its 3 pads), 4 x 11
        assert status["last_round"]["members"] == 2 and status["last_round"]["samples"] == 20 + 44
        # a copy that fell behind (as if another member's sync closed a round without it): the
        # server refuses its step's first forward; the model loads the shared weights, runs again
        a, b = models
        average = client_weights(b)
        a.remote.federation.version = a.remote.steps.fed_version = 0
        with torch.no_grad():
            a.transformer.wte.weight.zero_()
        calls, refused, real = a.remote.stats.calls, [], a.remote.steps.refused_for_federation
        a.remote.steps.refused_for_federation = lambda: refused.append(real()) or refused[-1]
        a(input_ids=batches[0][0], labels=batches[0][0]).loss.backward()
        assert refused == [True]  # the server said stale_weights once; the forward ran again
        assert a.remote.federation.version == 1 and torch.equal(client_weights(a)["transformer.wpe.weight"],
                                                                average["transformer.wpe.weight"])
        assert torch.equal(a.transformer.wte.weight, average["transformer.wte.weight"])
        assert a.remote.stats.calls - calls == 2  # answered tensor calls: the forward run again, its backward
        a.zero_grad()  # discards the step on the server
        for m in models:
            m.remote.close()


def test_sequential_turns_in_a_plain_loop_equal_the_unsplit_steps(tmp_path):
    """a trains two steps and syncs, then b (its first forward takes the turn and loads a's
    weights before computing anything), then a again (the same, with b's)."""
    order = [("a", 0), ("a", 1), ("b", 2), ("a", 3)]
    cuts = (1, 3)
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,
                             extra=["--federation", "sequential"]) as srv:
        models = {n: member(srv, n) for n in "ab"}
        opts = {n: torch.optim.SGD(m.parameters(), lr=LR["sgd"]) for n, m in models.items()}
        prev = None
        for name, b in order:
            if prev is not None and prev != name:
                models[prev].sync()
            sgd_step(models[name], opts[name], *BATCHES[b])
            prev = name
        models[prev].sync()
        reference, _ = unsplit_steps(cuts, "sgd", [BATCHES[b] for _, b in order])
        assert_both_sides_equal(reference, as_client(models["a"]), srv)
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["version"] == 3 and status["turn"] is None
        with pytest.raises(ConfigError, match="between optimizer steps"):
            models["a"].train()(input_ids=BATCHES[0][0], labels=BATCHES[0][0]).loss.backward()
            models["a"].sync()
        models["a"].zero_grad()
        for m in models.values():
            m.remote.close()
