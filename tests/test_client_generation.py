"""SplitClient generation against the server (its app in this process: tests/serverproc.py's
InprocServerProcess): equal to ``model.generate``.

``SplitClient.generate`` is transformers' ``generate`` on the client's split model
(``client.model``); two rows or more where the server has cores of its own run as two row
groups in flight (``RemoteCache.row_groups``: two sessions, two transport lanes), tested here
with ``pipeline=True``.

The servers here are never trained, so they hold the seeded random init of
models/tiny-varied.json (greedy tokens that vary: a drifting cache shows), the same weights as the
``tiny_model`` fixture of this module (tied or untied makes no difference before
training).
"""
import logging

import pytest
import torch

from splitlearn.client import SplitClient
from splitlearn.errors import ConfigError

from conftest import VARIED
from serverproc import TOKEN, InprocServerProcess, ServerProcess

pytestmark = pytest.mark.slow

NEW = 12  # new tokens per test; prompts are 23 long at most, so positions stay 2 digits


@pytest.fixture(scope="module")
def tiny_model(varied_model):
    """The unsplit reference: the tiny-varied model the servers here hold."""
    return varied_model


@pytest.fixture(scope="module", params=[(2,), (1, 3)], ids=["2way", "u"])
def server(request):
    with InprocServerProcess(request.param, model=VARIED) as srv:
        srv.cuts = request.param
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with SplitClient(server.url, VARIED, token=TOKEN, device="cpu") as c:
        yield c


@pytest.mark.parametrize("eos", [None, 256])
def test_greedy_equals_hf_generate(client, tiny_model, padded_batch, eos):
    ids, mask = padded_batch  # (3, 23), left-padded
    got = client.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=256)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=eos, pad_token_id=256)
    assert torch.equal(got, want)


def test_sampling_with_a_seed_is_reproducible(client, tiny_model, padded_batch):
    ids, mask = padded_batch
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=40, top_p=0.95)
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    a = client.generate(ids, mask, seed=11, **kw)
    assert torch.equal(torch.rand(3), before)  # the global RNG is left alone
    assert torch.equal(a, client.generate(ids, mask, seed=11, **kw))
    # the unsplit model's own draw with that seed: transformers' sampler on both
    torch.manual_seed(11)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **kw)
    assert torch.equal(a, want)
    assert not torch.equal(a, client.generate(ids, mask, seed=12, **kw))


def test_any_generate_option_reaches_transformers(client, tiny_model, padded_batch):
    """Beam search, repetition penalty and num_return_sequences: options the hand-written loop
    never had, through the same method."""
    ids, mask = padded_batch
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, repetition_penalty=1.3)
    got = client.generate(ids, mask, pad_token_id=256, **kw)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=256, **kw)
    assert got.shape[0] == 2 * ids.shape[0] and torch.equal(got, want)
    for bad in (dict(temperature=0.0, do_sample=True), dict(top_k=0, do_sample=True), dict(top_p=1.5, do_sample=True),
                dict(max_new_tokens=-1), dict(max_new_tokens=10_000)):
        with pytest.raises(ConfigError):
            client.generate(ids, mask, **bad)


def test_stream_yields_the_generated_tokens(client, padded_batch):
    ids, mask = padded_batch
    whole = client.generate(ids, mask, max_new_tokens=NEW)
    streamed = list(client.generate_stream(ids, mask, max_new_tokens=NEW))
    assert len(streamed) == NEW and all(t.shape == (3,) for t in streamed)
    assert torch.equal(torch.stack(streamed, dim=1), whole[:, ids.shape[1]:])


def test_the_model_classes_stream_too(client, padded_batch):
    """``model.generate_stream`` (splitlearn.hf.streaming): what SplitClient.generate_stream runs on."""
    ids, mask = padded_batch
    whole = client.generate(ids, mask, max_new_tokens=NEW)
    streamed = list(client.model.generate_stream(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                                                 do_sample=False, eos_token_id=None, pad_token_id=0))
    assert len(streamed) == NEW and torch.equal(torch.stack(streamed, dim=1), whole[:, ids.shape[1]:])


def test_each_decode_step_sends_only_the_new_position(client, padded_batch, monkeypatch):
    ids, mask = padded_batch
    B, T = ids.shape
    d = client.bottom.config.n_embd
    # the bodies of the session steps as they are sent (generate_stream runs generate() in a
    # thread of its own: sampling the byte counter between tokens would race with it)
    sizes, start = [], client.transport.start

    def recording(path, body, lane=0):
        if path.endswith("/step"):
            sizes.append(len(body))
        return start(path, body, lane)

    monkeypatch.setattr(client.transport, "start", recording)
    for _ in client.generate_stream(ids, mask, max_new_tokens=NEW):
        pass
    prefill, decode = sizes[0], sizes[1:]
    assert len(decode) == NEW - 1, sizes  # one call per new position after the prefill
    assert len(set(decode)) == 1, f"decode steps grow with the sequence: {decode}"
    # B x 1 x d float32 activations, a (B, 1) mask and a header; the prefill carried B x T x d
    assert B * d * 4 <= decode[0] <= B * d * 4 + B * 8 + 512
    assert prefill >= B * T * d * 4


def test_server_restart_mid_generation_changes_nothing(client, server, padded_batch, caplog):
    ids, mask = padded_batch
    want = client.generate(ids, mask, max_new_tokens=NEW)[:, ids.shape[1]:]
    stream = client.generate_stream(ids, mask, max_new_tokens=NEW)
    got = [next(stream) for _ in range(4)]
    server.restart()  # as SIGTERM and a new process on the same port: the session is gone
    with caplog.at_level(logging.WARNING):
        got += list(stream)
    assert "session" in caplog.text and "replay" in caplog.text  # the client really had to replay
    assert torch.equal(torch.stack(got, dim=1), want)


# -- two row groups in flight ----------------------------------------------------------------

class InFlight:
    """Records the client's tensor calls on ``transport``: each start and finish with its lane,
    and the most calls in flight at once (started, answer not yet read)."""

    def __init__(self, transport, monkeypatch):
        self.events, self.now, self.most = [], 0, 0
        start, finish = transport.start_call, transport.finish_call

        def start_call(path, tensors, meta=None, lane=0):
            call = start(path, tensors, meta, lane)
            self.now += 1
            self.most = max(self.most, self.now)
            self.events.append(("start", lane))
            return call

        def finish_call(pending):
            self.now -= 1
            self.events.append(("finish", pending.lane))
            return finish(pending)

        monkeypatch.setattr(transport, "start_call", start_call)
        monkeypatch.setattr(transport, "finish_call", finish_call)


S0, S1, F0, F1 = ("start", 0), ("start", 1), ("finish", 0), ("finish", 1)


def _pipelined(client, ids, mask, monkeypatch, **kw):
    """``client.generate(..., pipeline=True)``, checking the order of its calls: the overlap."""
    calls = InFlight(client.transport, monkeypatch)
    out = client.generate(ids, mask, pipeline=True, **kw)
    n, steps = out.shape[1] - ids.shape[1], kw["max_new_tokens"]  # forwards run, at most
    assert calls.most == 2  # the two groups' steps in flight at once, never more
    if kw.get("do_sample") or kw.get("num_beams", 1) > 1 or kw.get("repetition_penalty"):
        # each forward: both groups sent (lanes 0 and 1), then both answers read in that order
        assert calls.events == [S0, S1, F0, F1] * n
    else:
        # greedy: the first group's next step is sent as soon as its logits are known, before
        # the second group's answer is read (the overlap crosses steps); never after the last
        # step (one stays in flight when every row finished early: read and dropped at close)
        body = [S0, S1, F0] + [S0, F1, S1, F0] * (n - 1)
        assert calls.events == body + [F1] or (n < steps and calls.events == body + [S0, F1])
    return out


@pytest.mark.parametrize("eos", [None, 256])
def test_pipelined_greedy_equals_hf_generate(client, tiny_model, padded_batch, eos, monkeypatch):
    ids, mask = padded_batch  # (3, 23): groups of 2 and 1 rows
    got = _pipelined(client, ids, mask, monkeypatch, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=256)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=eos, pad_token_id=256)
    assert torch.equal(got, want)


def test_pipelined_group_that_finishes_first_pads_until_the_other_does(client, tiny_model, padded_batch,
                                                                       monkeypatch):
    ids, mask = padded_batch
    free = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    T = ids.shape[1]
    eos = int(free[2, T])  # the last row (the second group, alone) stops at once
    assert eos not in free[:2, T:T + 2].tolist()[0]  # ... while the first group goes on
    got = _pipelined(client, ids, mask, monkeypatch, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want) and (got[2, T + 1:] == 0).all()


def test_pipelined_sampling_and_beams_equal_hf_generate(client, tiny_model, padded_batch, monkeypatch):
    """Every strategy gets the two groups now (the hand loop was greedy only)."""
    ids, mask = padded_batch
    for kw in (dict(do_sample=True, temperature=0.9, top_k=40, seed=11),
               dict(num_beams=2, num_return_sequences=2, repetition_penalty=1.3)):
        got = _pipelined(client, ids, mask, monkeypatch, max_new_tokens=6, pad_token_id=256, **kw)
        seed = kw.pop("seed", None)
        if seed is not None:
            torch.manual_seed(seed)
        want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=256, **kw)
        assert torch.equal(got, want)


def test_pipelined_survives_a_server_restart(client, server, tiny_model, padded_batch, caplog):
    from transformers.generation.streamers import BaseStreamer

    class RestartAt4(BaseStreamer):  # inside generate, between two steps: both sessions are lost
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 5:  # the prompt, then 4 tokens
                server.restart()

        def end(self):
            pass

    ids, mask = padded_batch
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    with caplog.at_level(logging.WARNING):
        got = client.generate(ids, mask, max_new_tokens=NEW, pipeline=True, streamer=RestartAt4())
    lost = [r.getMessage() for r in caplog.records if "generation session" in r.getMessage()]
    assert len(lost) == 2 and all("lost; replaying" in m for m in lost)  # each group replayed its own
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def loopback_client(server):
    """A client of a real server process of the same shape, on loopback: whether the server
    has cores of its own is decided from the URL (loopback) and this process's affinity."""
    with ServerProcess(server.cuts, model=VARIED) as srv, \
            SplitClient(srv.url, VARIED, token=TOKEN, device="cpu") as c:
        yield c


def test_pipelining_is_on_only_where_the_server_has_cores_of_its_own(loopback_client, padded_batch,
                                                                      monkeypatch):
    import os

    client = loopback_client

    from splitlearn.transport import shares_cores_with_server

    model, t = client.model, client.transport
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(os.cpu_count() or 1)))
    assert shares_cores_with_server(t.cfg.url)  # loopback, every core: shared
    model.overlap = None
    assert not model.overlaps()
    if (os.cpu_count() or 1) >= 2:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # pinned: the server has the others
        # U-shape: on; 2-way: the client's bottom alone hides nothing
        assert model.overlaps() == client.u_shape
    model.overlap = True  # asked for: done
    assert model.overlaps()
    model.overlap = False
    assert not model.overlaps()
    # one row (or one prompt's beams): nothing to split; two rows: two groups
    ids, mask = padded_batch
    for rows, kw, lanes in ((1, {}, {0}), (1, dict(num_beams=2), {0}), (2, {}, {0, 1})):
        calls = InFlight(t, monkeypatch)
        client.generate(ids[:rows], mask[:rows], max_new_tokens=2, pipeline=True, **kw)
        assert {lane for _, lane in calls.events} == lanes
    calls = InFlight(t, monkeypatch)
    client.generate(ids, mask, max_new_tokens=2, pipeline=False)
    assert calls.events == [S0, F0] * 2 and calls.most == 1


def test_clients_generating_at_once_each_get_generates_tokens(server, tiny_model, padded_batch):
    """Four clients, one row each, decode against one server at the same time (their steps
    batched across sessions): each gets exactly what ``generate`` gives for its row, and the
    server counts every decode step once."""
    from serverproc import run_threads

    ids, mask = padded_batch  # (3, 23), left-padded
    rows = [(ids[i:i + 1], mask[i:i + 1]) for i in range(3)] + [(ids[:1, -7:], mask[:1, -7:])]
    want = [tiny_model.generate(input_ids=x, attention_mask=m, max_new_tokens=NEW, do_sample=False,
                                pad_token_id=256) for x, m in rows]
    clients = [SplitClient(server.url, VARIED, token=TOKEN, device="cpu") for _ in rows]
    before = clients[0].transport.get_json("/v1/info")["generation"]
    got = [None] * len(rows)

    def gen(i):
        def run():
            for _ in range(2):
                got[i] = clients[i].generate(*rows[i], max_new_tokens=NEW, pad_token_id=256)
        return run

    try:
        run_threads([gen(i) for i in range(len(rows))])
        after = clients[0].transport.get_json("/v1/info")["generation"]
    finally:
        for c in clients:
            c.close()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps == 2 * len(rows) * (NEW - 1)  # the prefill gives the first token
    assert 1 <= after["decode_forwards"] - before["decode_forwards"] <= steps
