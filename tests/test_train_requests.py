"""Issue 30: one training protocol, and what a step costs in requests.

Every training request a client sends, counted at its transport, per optimizer step once the
run is steady (the apply of step s rides on step s+1's first forward(s), so a step's own
requests are its pieces). Before issue 30: the model classes sent ``2M + 1`` (a forward and a
backward per micro-batch, then ``POST /v1/train/apply``), ``SplitClient``'s closed steps ``M``
(2-way, one ``/v1/train/step`` per micro-batch) or ``2M`` (U-shape). Now:

============  ===============================  =====================
shape         client                           requests per step
============  ===============================  =====================
U-shape       model classes, SplitClient       2M (forward, backward)
2-way         model classes                    2M (forward, backward)
2-way         SplitClient, ``loss_gradient``   M  (fused /v1/train/step)
============  ===============================  =====================
"""
import collections

import pytest
import torch

from splitlearn import SplitClient
from splitlearn.api import protocol as P
from splitlearn.hf import SplitGPT2LMHeadModel

from serverproc import TOKEN, InprocServerProcess

pytestmark = pytest.mark.slow

STEPS = 3
TRAIN = (P.TRAIN_STEP, P.TRAIN_FORWARD, P.TRAIN_BACKWARD, P.TRAIN_APPLY)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(step))


class Counter:
    """The training requests ``transport`` sends (tensor calls and JSON alike), by path, and
    how many carried an apply."""

    def __init__(self, transport):
        self.paths, self.carried = collections.Counter(), 0
        start, send = transport.start_call, transport._send

        def start_call(path, tensors, meta=None, lane=0):
            if path in TRAIN:
                self.paths[path] += 1
                self.carried += "apply" in (meta or {})
            return start(path, tensors, meta, lane)

        def _send(method, path, **kw):
            if path in TRAIN:
                self.paths[path] += 1
            return send(method, path, **kw)

        transport.start_call, transport._send = start_call, _send

    def take(self) -> tuple[dict, int]:
        out = (dict(self.paths), self.carried)
        self.paths.clear()
        self.carried = 0
        return out


def model_class_steps(url: str, m: int, loss_gradient=None) -> list:
    # apply_wait_s: the test counts what the steps carry, whatever the machine's speed (an apply
    # sent alone after 0.1 s idle is test_an_idle_client_...'s subject)
    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=url, token=TOKEN, micro_batches=m,
                                                 apply_wait_s=30).train()
    model.loss_gradient = loss_gradient
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    count, per_step = Counter(model.remote.transport), []
    for step in range(STEPS):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        per_step.append(count.take())
    assert model.flush()["applied"]  # the last step's apply, on its own
    per_step.append(count.take())
    model.remote.close()
    return per_step


def split_client_steps(url: str, m: int) -> list:
    count, per_step = None, []
    with SplitClient(url, "tiny", token=TOKEN, device="cpu", micro_batches=m) as client:
        client.model.remote.applier.idle_s = 30  # as model_class_steps' apply_wait_s
        count = Counter(client.transport)
        for step in range(STEPS):
            client.train_step(batch(step))
            per_step.append(count.take())
        assert client.flush()["applied"]
        per_step.append(count.take())
    return per_step


def expected(m: int, fused: bool) -> list:
    """Per step: the pieces' requests; from step 2 on the first forward(s) carry the last apply;
    then the flush: one POST /v1/train/apply."""
    if fused:
        pieces = {P.TRAIN_STEP: m}
    else:
        pieces = {P.TRAIN_FORWARD: m, P.TRAIN_BACKWARD: m}
    return [pieces] * STEPS + [{P.TRAIN_APPLY: 1}]


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_requests_per_step(cuts, m):
    u = len(cuts) == 2
    runs = {}
    for name, steps, fused in (("model classes", lambda url: model_class_steps(url, m), False),
                               ("model classes, loss_gradient=1", lambda url: model_class_steps(url, m, 1.0), not u),
                               ("SplitClient", lambda url: split_client_steps(url, m), not u)):
        with InprocServerProcess(cuts) as srv:  # one client each: an uncontended segment (no apply_now)
            runs[name] = (steps(srv.url), fused)
    for name, (per_step, fused) in runs.items():
        paths = [p for p, _ in per_step]
        assert paths == expected(m, fused), (name, paths)
        assert sum(paths[1].values()) == (m if fused else 2 * m), name  # no apply request inside training
        carried = [c for _, c in per_step[:STEPS]]
        assert carried[0] == 0 and all(c >= 1 for c in carried[1:]), (name, carried)  # step 1 has nothing to carry
        assert all(c <= m for c in carried), (name, carried)  # only the step's first forwards (those in flight)


def test_an_idle_client_keeps_its_deferred_step_while_another_waits_for_the_lease():
    """The attack on a carried apply: client A finishes step 1 (its apply deferred to step 2's
    forward, the shared segment's lease still A's) and idles past ``--lease-timeout`` while B
    waits for the lease. The server would drop A's step at the timeout (409 at A's next step,
    the step lost); the idle flush sends the apply after a third of the timeout instead
    (``apply_wait_s`` caps it, 0.1 s by default: here 10, so the lease's third decides)."""
    import threading
    import time

    with InprocServerProcess((1, 3), extra=["--lease-timeout", "3"]) as srv:
        models = []
        for _ in range(2):
            m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, apply_wait_s=10).train()
            models.append((m, torch.optim.SGD(m.parameters(), lr=1e-2)))
        (a, opt_a), (b, opt_b) = models
        assert a.remote.applier.idle_s == pytest.approx(1.0)  # a third of the timeout: 2 s of slack on a loaded host

        def step(model, opt, i):
            ids = batch(i)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        step(a, opt_a, 0)
        assert a.remote.deferred is not None  # step 1's apply waits for step 2's forward
        done = []
        other = threading.Thread(target=lambda: (step(b, opt_b, 1), b.flush(), done.append(b.remote.last_apply)))
        other.start()  # B's forward waits for the lease A holds
        time.sleep(3.5)  # A idles past the lease timeout
        assert a.remote.deferred is None and a.remote.last_apply["applied"]  # sent alone, before the timeout
        step(a, opt_a, 2)  # A's next step: no 409, nothing lost
        a.flush()  # (B waiting, the server may have asked for step 2's apply at once)
        assert a.remote.last_apply["applied"] and a.remote.last_apply["step"] == 2
        other.join(30)
        assert done and done[0]["applied"]  # B got the lease once A's apply came
        for m, _ in models:
            m.remote.close()


def test_an_owner_waiting_for_the_segment_is_not_held_up_by_another_owners_deferred_apply():
    """Two owners take turns, one step each, on the shared U-shape segment (the default lease of
    60 s). Owner A's apply waits for A's next step to carry it, and holds the segment meanwhile;
    A does not come back, so after ``apply_wait_s`` (0.1 s) it is sent alone and B's step goes
    through: B waits well under the 20 s a third of the lease would cost (the old idle flush),
    and both steps are applied."""
    import time

    with InprocServerProcess((1, 3)) as srv:
        models = []
        for _ in range(2):
            m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN).train()
            models.append((m, torch.optim.SGD(m.parameters(), lr=1e-2)))
        assert models[0][0].remote.applier.idle_s == pytest.approx(0.1)
        waits = []
        for i, (m, opt) in enumerate(models):
            t0 = time.monotonic()
            m(input_ids=batch(i), labels=batch(i)).loss.backward()
            opt.step()
            opt.zero_grad()
            waits.append(time.monotonic() - t0)
        assert waits[1] < 10, waits  # not 20 s
        for m, _ in models:
            m.flush()
            assert m.remote.last_apply["applied"] and m.remote.last_apply["step"] == 1
            m.remote.close()


def test_a_deferred_apply_stuck_on_a_dead_server_does_not_hold_up_another_segments():
    """The idle flusher is one thread per process; a flush waiting out a dead server's reconnect
    window (a model whose server went away, in the same process) held up every other model's
    flush, whose leases then lapsed: a suite run saw an owner wait 21.9 s instead of 0.1 s. Each
    flush is now sent from a thread of its own."""
    import threading
    import time

    from splitlearn.hf.applies import IdleFlusher

    release, sent = threading.Event(), {}

    class Applier:  # what the flusher reads and calls: deferred, segment, idle_flush(req, segment)
        def __init__(self, blocks: bool, deferred: str):
            self.blocks, self.deferred, self.segment = blocks, deferred, self

        def idle_flush(self, req, segment):
            if self.blocks:
                release.wait(30)  # the dead server's reconnect window
            sent[req] = time.monotonic()

    flusher, stuck, other = IdleFlusher(), Applier(True, "stuck's apply"), Applier(False, "other's apply")
    try:
        t0 = time.monotonic()
        flusher.schedule(stuck, "stuck's apply", 0.0)
        flusher.schedule(other, "other's apply", 0.05)
        deadline = time.monotonic() + 5
        while "other's apply" not in sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "other's apply" in sent and sent["other's apply"] - t0 < 5
        assert "stuck's apply" not in sent  # still waiting, and nobody waited for it
    finally:
        release.set()
