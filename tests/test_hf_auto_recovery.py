"""Crash recovery of the other families' split client (``AutoSplitModelForCausalLM``, docs/MODELS.md):
a tiny Llama (GQA) and Gemma 2 trained by a plain PyTorch loop (two pieces per optimizer step:
gradient accumulation) against an in-process server that checkpoints every 3 steps.

* The server dies (no checkpoint at the end: what SIGKILL leaves) and comes back from its
  checkpoint directory behind the client: the request log replays the lost steps and every loss
  and every weight on both sides equals an undisturbed run's, bit for bit (float32 wire).
* The client dies after step 5 (nothing more sent) and a new model with the same ``journal_dir``
  resumes (``model.resume(optimizer)``): the same, bit for bit.

The attack on the guarantee: a server that forgot steps 4-5 answering as if nothing happened
(the losses would differ), and a resumed client that sends step 4 again to a server that has
applied it (the server's weights would differ).
"""
import pytest
import torch

import families as fam
from splitlearn import AutoSplitModelForCausalLM
from splitlearn.api import protocol as P

from serverproc import TOKEN, InprocServerProcess
from test_recovery import assert_identical  # every loss and every weight, bit for bit

pytestmark = pytest.mark.slow

STEPS, PIECES, EVERY, LR = 7, 2, 3, 1e-2
CASES = [("llama-gqa", (1, 3)), ("llama-gqa", (2,)), ("gemma2", (1, 3)), ("gemma2", (2,))]
IDS = [f"{n}-{'u' if len(c) == 2 else '2way'}" for n, c in CASES]


def pieces():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(PIECES):
            ids = torch.randint(3, fam.V, (2, 8), generator=g)
            mask = torch.ones_like(ids)
            mask[0, :2] = 0  # a left-padded row: positions from the mask on both sides
            step.append((ids.masked_fill(mask == 0, fam.PAD), mask, ids.masked_fill(mask == 0, -100)))
        out.append(step)
    return out


def kill(srv: InprocServerProcess) -> None:
    """What SIGKILL leaves: the URL answers nothing and the server writes no checkpoint."""
    from splitlearn.transport.inproc import unserve

    rt, srv.app = srv.app.extensions.get("splitlearn"), None
    unserve(srv.url, timeout_s=30)
    rt.compute.close()


def train(model, opt, start=1, stop=STEPS + 1, before=None):
    losses = []
    for step, batch in enumerate(pieces(), start=1):
        if not start <= step < stop:
            continue
        if before is not None:
            before(step)
        for ids, mask, labels in batch:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            (loss / PIECES).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def server(name, cuts, d):
    folder = d / "model"
    if not folder.exists():
        fam.model(name).save_pretrained(folder)
    return InprocServerProcess(cuts, lr=LR, model=str(folder), checkpoint_dir=d / "server",
                               extra=["--checkpoint-every", str(EVERY)])


def make(srv, d, **kw):
    m = AutoSplitModelForCausalLM.from_pretrained(str(d / "model"), server=srv.url, token=TOKEN, client_id="c",
                                                  **kw).train()
    return m, m.attach_optimizer(torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0))


def ends(model, srv, losses):
    client = {k: v.clone() for k, v in model.state_dict().items() if "remote." not in k}
    model.remote.flush()
    out = (losses, client, srv.weights())
    model.remote.close()
    return out


def undisturbed(name, cuts, d):
    with server(name, cuts, d) as srv:
        torch.manual_seed(0)
        model, opt = make(srv, d)
        return ends(model, srv, train(model, opt))


@pytest.mark.parametrize("name,cuts", CASES, ids=IDS)
def test_a_server_restarted_from_its_checkpoint_is_replayed_to(name, cuts, tmp_path):
    ref = undisturbed(name, cuts, tmp_path / "ref")
    d = tmp_path / "killed"
    with server(name, cuts, d) as srv:
        torch.manual_seed(0)
        model, opt = make(srv, d)

        def crash(step):
            if step == 6:  # steps 4 and 5 are after the checkpoint of step 3: lost
                kill(srv)
                srv.start()  # from its checkpoint directory, at the same URL

        out = ends(model, srv, train(model, opt, before=crash))
    assert_identical(out, ref)
    rec = model.remote.journal.recoveries
    assert len(rec) == 1 and rec[0]["server_step"] == 3 and rec[0]["steps"] == 2, rec


@pytest.mark.parametrize("name,cuts", CASES[:1] + CASES[3:], ids=IDS[:1] + IDS[3:])
def test_a_client_killed_mid_training_resumes_from_its_journal(name, cuts, tmp_path):
    ref = undisturbed(name, cuts, tmp_path / "ref")
    d = tmp_path / "killed"
    with server(name, cuts, d) as srv:
        torch.manual_seed(0)
        model, opt = make(srv, d, journal_dir=d / "client")
        model.remote.applier.idle_s = 0  # the dead process sends nothing more: no idle flush,
        model.remote.last_call.detach()  # no last call at exit
        losses = train(model, opt, stop=6)
        model, opt = make(srv, d, journal_dir=d / "client")  # (the dead one is never used again)
        start = model.resume(opt)
        assert 1 < start < 6 and model.remote.step == start  # its checkpoint is behind the server
        state = model.remote.transport.get_json(P.CLIENT_STATE.format(client_id="c"))
        redone = train(model, opt, start=start, stop=6)
        assert redone == losses[len(losses) - len(redone):]  # answered from the journal
        losses += train(model, opt, start=6)
        out = ends(model, srv, losses)
    assert int(state["step"]) >= 4  # the server had applied steps the client's checkpoint had not
    assert_identical(out, ref)
