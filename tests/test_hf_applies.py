"""Issue 41: the last optimizer step is never lost, and a stalled step says so.

A script that trains and simply ends (no ``flush()``, no ``close()``) used to leave its last
step's apply on the client: it rides on the next step's first forward, and the idle flusher that
would send it alone is a daemon thread, which dies with the process (a 3-step loop moved the
server twice, ``Trainer(max_steps=2)`` once). Here real scripts (tests/applyscripts.py) run as
processes of their own against one real server and end; the server must have applied exactly
their optimizer steps, and both sides must hold what the unsplit model holds after those steps.
A script that dies between a forward and its backward left the next run of the same client id
waiting for the 60 s lease, silent: the next run now takes its step over at once.
"""
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import forkserver
from applyscripts import LR, batch
from serverproc import TOKEN, InprocServerProcess, ServerProcess, web
from splitlearn import load_model
from splitlearn.api import protocol as P
from splitlearn.errors import ServiceUnavailable
from splitlearn.server.engine.lease import StepLease
from splitlearn.transport import busy

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --max-grad-norm: a fixed bound no step here reaches, instead of the default bound from the
    # norms of the steps before (the scenarios' steps differ in size; the unsplit model has none)
    with ServerProcess((1, 3), optimizer="sgd", lr=LR, checkpoint_dir=tmp_path_factory.mktemp("ck"),
                       extra=["--max-grad-norm", "1e9"]) as srv:
        yield srv


def steps_applied(srv) -> int:
    return web.get(srv.url + P.INFO, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()["steps_applied"]


def run_script(tmp_path: Path, *args: str) -> list[dict]:
    """``python -m applyscripts ARGS`` (forked from the tests' preloaded interpreter when it can
    be, as the servers are) to its end -> its JSON lines. Fails with its stderr if it fails."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = {**os.environ, "SPLITLEARN_TOKEN": TOKEN, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(out, "w") as so, open(err, "w") as se, contextlib.chdir(TESTS):  # python -m finds it here
        proc = forkserver.launch([sys.executable, "-m", "applyscripts", *args], env=env, stdout=so, stderr=se)
        code = proc.wait(300)
    assert code == 0, err.read_text()[-3000:]
    assert "Traceback" not in err.read_text(), err.read_text()[-3000:]  # nothing went wrong at exit either
    return [json.loads(x) for x in out.read_text().splitlines() if x.startswith('{"')]  # (Trainer prints dicts)


def unsplit(server_before: dict, batches: list) -> dict:
    """The unsplit model, from the same weights, after one SGD step per batch."""
    full = load_model("tiny")  # the client's start (the same spec and seed)
    full.load_state_dict(server_before, strict=False)  # the server's blocks as they were
    full.train()
    opt = torch.optim.SGD(full.parameters(), lr=LR)
    for ids in batches:
        full(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return full.state_dict()


def assert_unsplit(server_before: dict, server_after: dict, client: dict, ref: dict) -> None:
    """The unsplit model's weights ``ref`` are what the server (its blocks) and the client (the
    rest) hold."""
    assert set(server_after) and set(client) and set(server_after) | set(client) >= {"lm_head.weight"}
    for name, have in [*server_after.items(), *client.items()]:
        torch.testing.assert_close(have, ref[name], msg=name)
    moved = [k for k in server_after if not torch.equal(server_after[k], server_before[k])]
    assert moved, "the server's blocks did not move"


@pytest.mark.parametrize("scenario,steps", [("model", 3), ("client", 3), ("trainer", 2), ("dropped", 2)])
def test_a_script_that_simply_ends_loses_no_step(server, tmp_path, scenario, steps):
    """A plain loop over the model class, ``SplitClient.train_step`` and ``Trainer(max_steps=2)``,
    each ending without flush or close: the exit sends the last apply. ``dropped``: the model is
    garbage collected, then the process dies without its exit handlers (``os._exit``): the model's
    finalizer sent it."""
    before, weights = steps_applied(server), server.weights()
    extra = [str(server.checkpoint_dir)] if scenario == "trainer" else []
    run_script(tmp_path, scenario, server.url, str(tmp_path), f"c-{scenario}", *extra)
    assert steps_applied(server) - before == steps
    # Trainer: the same Trainer on the unsplit model, run by the script (its loss normalisation is its own)
    ref = load_file(str(tmp_path / "unsplit.safetensors")) if scenario == "trainer" else \
        unsplit(weights, [batch(s) for s in range(steps)])
    assert_unsplit(weights, server.weights(), load_file(str(tmp_path / "client.safetensors")), ref)


def test_a_new_run_takes_over_the_step_a_dead_run_left(server, tmp_path, monkeypatch):
    """A script dies between a forward and its backward (the shared segment's lease still its
    own, 60 s); the next run with the same client id trains at once, and exactly: the dead run's
    forward changed nothing and none of its answers is reused. The dead run is a process of its
    own; the next run is the same script's loop in this process (how a run ends is the other
    tests' subject: here its last apply is flushed)."""
    from applyscripts import model_class

    before, weights = steps_applied(server), server.weights()
    (tmp_path / "dead").mkdir()
    assert run_script(tmp_path / "dead", "abandon", server.url, str(tmp_path / "dead"), "owner") == [{"abandoned": 1}]
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    run = model_class(server.url, "owner", 2, tmp_path)
    run["model"].flush()  # the last step's apply, if it is still deferred: sent now
    run["model"].remote.close()
    assert run["step_s"][0] < 20, run["step_s"]  # not the 60 s lease
    assert steps_applied(server) - before == 2
    assert_unsplit(weights, server.weights(), load_file(str(tmp_path / "client.safetensors")),
                   unsplit(weights, [batch(0), batch(1)]))


def test_export_adapter_holds_the_servers_last_step(tmp_path):
    """``export_adapter`` right after the last ``train_step`` (its apply still deferred): the exported
    server-side adapter is the server's, after every step."""
    from peft import LoraConfig

    from splitlearn import SplitClient
    from splitlearn.hf.lora import fetch_server_adapter

    with InprocServerProcess((1, 3), optimizer="sgd", extra=["--lora-r", "4", "--lora-alpha", "8",
                                                             "--lora-targets", "c_attn,c_proj"]) as srv:
        client = SplitClient(srv.url, "tiny", token=TOKEN, device="cpu", optimizer="sgd", lr=1e-2,
                             lora=LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                             fan_in_fan_out=True))
        client.model.remote.applier.idle_s = 30  # not the idle flusher: export_adapter sends it
        for step in range(2):
            client.train_step(batch(step))
        out = client.export_adapter(tmp_path / "adapter")
        exported = load_file(str(out / "adapter_model.safetensors"))
        server = fetch_server_adapter(client.transport, client.client_id)
        assert client.model.remote.last_apply["step"] == 2
        assert server and all(torch.equal(exported[k], v) for k, v in server.items())
        client.close()


def test_the_lease_names_its_holder_to_its_own_tenant_only():
    lease = StepLease(60.0)
    lease.acquire("alice:owner", 3)
    with pytest.raises(ServiceUnavailable) as mine:
        lease.acquire("alice:other", 1)
    assert "step 3 of client 'owner'" in mine.value.message and "held for" in mine.value.message
    with pytest.raises(ServiceUnavailable) as theirs:
        lease.acquire("mallory:x", 1)
    assert "another tenant's step" in theirs.value.message
    # nothing of the other tenant's: no id, no step, no time held or left (issue 50, item 9)
    assert "owner" not in theirs.value.message and "alice" not in theirs.value.message
    assert not any(ch.isdigit() for ch in theirs.value.message) and theirs.value.retry_after == 1.0


def test_a_client_waiting_for_the_segment_says_who_holds_it(monkeypatch, caplog):
    monkeypatch.setattr(busy, "BUSY_LOG_S", 0.05)
    answers = iter([ServiceUnavailable("the segment is busy with step 3 of client 'owner'", retry_after=0.02)] * 12)

    def call():
        e = next(answers, None)
        if e is not None:
            raise e
        return "done"

    with caplog.at_level(logging.WARNING, logger="splitlearn.transport.busy"):
        assert busy.wait_while_busy(call, "the segment", 30.0) == "done"
    said = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert said and all("client 'owner'" in m and "for the segment" in m for m in said), said
