"""kill -9 of the server while a model class trains: the request log replays what it lost.

Each test trains one run undisturbed and one with the server killed (SIGKILL) and restarted
from its checkpoint directory at once (a fork: down for a moment), with a plain PyTorch loop over
``SplitGPT2LMHeadModel`` (two pieces per optimizer step: gradient accumulation), and compares
every loss and every weight on both sides bit for bit (float32 wire).
"""
import json
import threading

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.errors import Conflict
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.hf.journal import RequestLog, Sent, digest

from serverproc import TOKEN, InprocServerProcess, ServerProcess
from test_recovery import assert_identical  # every loss and every weight, bit for bit

pytestmark = pytest.mark.slow

STEPS, PIECES, EVERY, LR = 7, 2, 3, 1e-2


def pieces():
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 256, (2, 10), generator=g) for _ in range(PIECES)] for _ in range(STEPS)]


def run(cuts, tmp, kill_at=None, restart_from=None, micro_batches=1):
    """Train; ``kill_at`` = (step, what) with what in "before" (before the step's first
    forward), "backward" (before piece 1's backward), "apply" (before the step's apply): the
    server is killed there and restarted at once (it is down until the new process answers). Returns (losses, client, server weights,
    the model's recoveries). Undisturbed (no ``kill_at``), the server is the same app in this
    process (tests/serverproc.py's InprocServerProcess: the same answers, bit for bit)."""
    server = ServerProcess if kill_at else InprocServerProcess
    srv = server(cuts, lr=LR, checkpoint_dir=tmp, extra=["--checkpoint-every", str(EVERY)])
    with srv:
        model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="c",
                                                     retries=1, micro_batches=micro_batches).train()
        remote = model.remote
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        fired = []

        def crash():
            fired.append(1)
            srv.kill()
            if restart_from is not None:
                restart_from(srv)
            threading.Thread(target=srv.start, daemon=True).start()  # (its start waits until it answers)

        real = remote.transport.call_meta, remote.transport.post_json, remote.transport.start_call

        def kill_before(path, meta):
            if kill_at and not fired and kill_at[1] == "backward" and path == P.TRAIN_BACKWARD \
                    and remote.step == kill_at[0] and meta["micro"] == "1":
                crash()
            if kill_at and not fired and kill_at[1] == "apply" and "apply" in (meta or {}) \
                    and json.loads(meta["apply"])["step"] == kill_at[0]:  # the next step's first forward carries it
                crash()

        def call_meta(path, tensors, meta=None, lane=0):
            kill_before(path, meta)
            return real[0](path, tensors, meta, lane)

        def start_call(path, tensors, meta=None, lane=0):  # pipelined pieces
            kill_before(path, meta)
            return real[2](path, tensors, meta, lane)

        def post_json(path, payload):
            if kill_at and not fired and kill_at[1] == "apply" and path == P.TRAIN_APPLY \
                    and payload.get("step") == kill_at[0] and not payload.get("discard"):
                crash()
            return real[1](path, payload)

        remote.transport.call_meta, remote.transport.post_json = call_meta, post_json
        remote.transport.start_call = start_call
        losses = []
        try:
            for step, batch in enumerate(pieces(), start=1):
                if kill_at == (step, "before"):
                    crash()
                for ids in batch:
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / PIECES).backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad()
        except BaseException:  # a run that fails (a test expects it) makes no last call at the exit of
            remote.last_call.detach()  # the test process, to a server gone by then (a 5 s wait there)
            raise
        assert bool(kill_at) == bool(fired)
        client = {k: v.clone() for k, v in model.state_dict().items() if "remote." not in k}
        server = srv.weights()
        model.remote.close()
    return losses, client, server, remote.journal.recoveries


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return {cuts: run(cuts, tmp_path_factory.mktemp("ref")) for cuts in [(1, 3), (2,)]}


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_server_killed_between_steps_replays_the_lost_ones(reference, tmp_path, cuts):
    out = run(cuts, tmp_path, kill_at=(6, "before"))
    assert_identical(out, reference[cuts])
    # steps 4 and 5 were after the checkpoint of step 3: two steps of 2 pieces (fwd + bwd), step 4's
    # apply (carried by step 5's first forward, logged as an apply); step 5's rides on the request
    # that failed (step 6's first forward), sent again after the replay
    assert out[3] == [{"server_step": 3, "replayed": 2 * (2 * PIECES + 1) - 1, "steps": 2}], out[3]


@pytest.mark.parametrize("cuts,what", [((1, 3), "backward"), ((2,), "apply")], ids=["u-backward", "2way-apply"])
def test_server_killed_inside_a_step(reference, tmp_path, cuts, what):
    """Mid-step: the step's pieces so far are replayed too, then the request that failed."""
    out = run(cuts, tmp_path, kill_at=(5, what))
    assert_identical(out, reference[cuts])
    done = 2 * PIECES if what == "apply" else PIECES + 1  # step 5's requests before the kill
    # "apply": the kill comes with step 6's first forward, which carries step 5's apply (so step 5's
    # pieces are replayed as a step before the one in progress)
    steps = 2 if what == "apply" else 1
    assert out[3] == [{"server_step": 3, "replayed": (2 * PIECES + 1) + done, "steps": steps}], out[3]


def test_server_killed_inside_a_pipelined_step(tmp_path):
    """Micro-batches in flight on several connections when the server dies: the same replay."""
    undisturbed = run((1, 3), tmp_path / "ref", micro_batches=2)
    out = run((1, 3), tmp_path / "kill", kill_at=(5, "backward"), micro_batches=2)
    assert_identical(out, undisturbed)
    assert out[3] and out[3][0]["server_step"] == 3, out[3]


def test_a_server_restarted_from_an_older_state_is_refused(tmp_path):
    """The server comes back without the checkpoint the log starts from: Conflict, named."""
    import shutil

    def wipe(srv):
        shutil.rmtree(srv.checkpoint_dir)

    with pytest.raises(Conflict, match="not in its request log"):
        run((1, 3), tmp_path / "ck", kill_at=(6, "before"), restart_from=wipe)


def test_the_log_keeps_only_what_is_not_durable_and_checks_answers():
    log = RequestLog(enabled=True)
    t = {"hidden": torch.ones(2, 3)}
    for step in (1, 2, 3):
        log.record(step, Sent(P.TRAIN_FORWARD, t, {"step": str(step)}, digest(t)))
    assert log.nbytes() == 3 * 6 * 4
    log.durable(2)
    assert list(log.steps) == [3] and log.nbytes() == 24
    sent = []
    assert log.replay(2, 4, lambda r: sent.append(r) or t) == 1 and sent[0].meta == {"step": "3"}
    with pytest.raises(Conflict, match="differs"):
        log.replay(2, 4, lambda r: {"hidden": torch.zeros(2, 3)})
    with pytest.raises(Conflict, match="steps 2..2 are not in its request log"):
        log.replay(1, 4, lambda r: t)
    off = RequestLog(enabled=False)
    off.record(1, Sent(P.TRAIN_FORWARD, t, {}))
    assert off.steps == {}
    assert digest({"a": torch.zeros(2)}) != digest({"a": torch.zeros(2, 1)}) != digest({"b": torch.zeros(2)})


def test_a_logged_digest_of_either_kind_is_checked_on_any_device():
    """Answers on a GPU are logged with the digest of their sums (no host copy); the check
    (journal.matches) recomputes the kind it finds, on whatever device the answer is now: a log
    written on a GPU checks on the CPU after a crash, and a log of the BLAKE2b kind still checks."""
    from splitlearn.api.fingerprint import digest as fingerprint_digest
    from splitlearn.hf.journal import FINGERPRINT, bytes_digest, matches

    t = {"hidden": torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)}
    other = {"hidden": t["hidden"].clone()}
    other["hidden"][1, 4, 2] += 1
    made_on_gpu = FINGERPRINT + fingerprint_digest(t)  # what digest() makes of CUDA tensors
    assert len(made_on_gpu) == 17 and matches(t, made_on_gpu) and not matches(other, made_on_gpu)
    assert matches(t, bytes_digest(t)) and not matches(other, bytes_digest(t))
    assert digest(t) == bytes_digest(t)  # tensors in host memory: the bytes' digest, as before
    if torch.cuda.is_available():
        on_gpu = {k: v.cuda() for k, v in t.items()}
        assert digest(on_gpu) == made_on_gpu and matches(t, digest(on_gpu))


# -- the client killed: the journal on disk (journal_dir), model.resume(optimizer) -------------

def train(model, opt, start=1, stop=STEPS + 1):
    """The plain loop of ``run`` over steps ``start`` .. ``stop - 1``; returns the losses."""
    losses = []
    for step, batch in enumerate(pieces(), start=1):
        if start <= step < stop:
            for ids in batch:
                loss = model(input_ids=ids, labels=ids).loss
                (loss / PIECES).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    return losses


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
@pytest.mark.parametrize("crash", ["between-steps", "mid-step"])
def test_a_model_class_killed_mid_training_resumes_exactly(tmp_path, cuts, crash):
    """The process dies (nothing more sent, nothing flushed) after step 5, or inside step 6
    with one piece on the server; a new model with the same journal_dir resumes at its client
    checkpoint, the steps the server has applied are answered from the journal, and the run
    ends bit-identical to an undisturbed one on both sides. The server lives throughout: it is
    the same app in this process (InprocServerProcess), the dying client this process's model."""
    results = {}
    for name in ("undisturbed", "killed"):
        d = tmp_path / name
        with InprocServerProcess(cuts, lr=LR, checkpoint_dir=d / "server",
                                 extra=["--checkpoint-every", str(EVERY)]) as srv:
            def make():
                m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, client_id="c",
                                                         journal_dir=d / "client").train()
                return m, m.attach_optimizer(torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0))

            torch.manual_seed(0)
            model, opt = make()
            if name == "undisturbed":
                losses = train(model, opt)
            else:
                # this process "dies" after step 5, so nothing of this model may reach the server after
                # that: not even the idle flush of step 5's deferred apply, which a live model in this
                # process would send 0.1 s later (racing the resumed model's replay of step 5), nor
                # the last call its finalizer makes when it is collected (kill -9 runs neither)
                model.remote.applier.idle_s = 0
                model.remote.last_call.detach()
                losses = train(model, opt, stop=6)
                if crash == "mid-step":  # step 6's first piece reaches the server, then the process dies
                    ids = pieces()[5][0]
                    (model(input_ids=ids, labels=ids).loss / PIECES).backward()
                assert list((d / "client" / "wal").glob("*.safetensors"))  # the steps after the checkpoint
                model, opt = make()  # (the dead one is never used again)
                start = model.resume(opt)
                assert 1 < start < 6 and model.remote.step == start  # the checkpoint is behind the server
                calls = model.remote.stats.calls
                redone = train(model, opt, start=start, stop=6)
                assert redone and redone == losses[len(losses) - len(redone):]  # the same losses, from the journal
                # and no request, but for step 5's pieces when the process died before its apply
                # went (carried by step 6's first forward): the server never applied it
                again = 2 * PIECES if crash == "between-steps" else 0
                assert model.remote.stats.calls == calls + again and not model.remote.journal._redo
                losses += train(model, opt, start=6)
            client = {k: v.clone() for k, v in model.state_dict().items() if "remote." not in k}
            results[name] = (losses, client, srv.weights())
            model.remote.close()
    assert_identical(results["killed"], results["undisturbed"])
