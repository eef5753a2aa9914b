"""SplitClient generation against a real server process: equal to ``model.generate``.

``SplitClient.generate`` is transformers' ``generate`` on the client's split model
(``client.model``); greedy decoding of two rows or more where the server has cores of its own
runs the pipelined decode (two row groups in flight), tested here with ``pipeline=True``.

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
from splitlearn.generation import GreedyConfig

from conftest import VARIED
from serverproc import TOKEN, ServerProcess

pytestmark = pytest.mark.slow

NEW = 12  # new tokens per test; prompts are 23 long at most, so positions stay 2 digits


@pytest.fixture(scope="module")
def tiny_model(varied_model):
    """The unsplit reference: the tiny-varied model the servers here hold."""
    return varied_model


@pytest.fixture(scope="module", params=[(2,), (1, 3)], ids=["2way", "u"])
def server(request):
    with ServerProcess(request.param, model=VARIED) as srv:
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


def test_each_decode_step_sends_only_the_new_position(client, padded_batch):
    ids, mask = padded_batch
    B, T = ids.shape
    d = client.bottom.config.n_embd
    sent = [client.stats.bytes_sent]
    for _ in client.generate_stream(ids, mask, max_new_tokens=NEW):
        sent.append(client.stats.bytes_sent)
    per_step = [b - a for a, b in zip(sent, sent[1:])]
    prefill, decode = per_step[0], per_step[1:]
    assert len(set(decode)) == 1, f"decode steps grow with the sequence: {decode}"
    # B x 1 x d float32 activations, a (B, 1) mask and a header; the prefill carried B x T x d
    assert B * d * 4 <= decode[0] <= B * d * 4 + B * 8 + 512
    assert prefill >= B * T * d * 4


def test_server_restart_mid_generation_changes_nothing(client, server, padded_batch, caplog):
    ids, mask = padded_batch
    want = client.generate(ids, mask, max_new_tokens=NEW)[:, ids.shape[1]:]
    stream = client.generate_stream(ids, mask, max_new_tokens=NEW)
    got = [next(stream) for _ in range(4)]
    server.restart()  # SIGTERM and a new process on the same port: the session is gone
    with caplog.at_level(logging.WARNING):
        got += list(stream)
    assert "session" in caplog.text and "replay" in caplog.text  # the client really had to replay
    assert torch.equal(torch.stack(got, dim=1), want)


# -- the pipelined decoder: two row groups in flight ---------------------------------------

def _pipelined(client, ids, mask, **kw):
    from splitlearn.client.generation import RemoteDecoder

    remote = RemoteDecoder(client.transport, client.segments, ids.shape[0], client.wire_dtype, client._local)
    try:
        new = list(remote.decode(ids, mask, GreedyConfig(**kw)))
        assert len(remote.groups) == 2 and [g.rows for g in remote.groups] == [(ids.shape[0] + 1) // 2,
                                                                                 ids.shape[0] // 2]
    finally:
        remote.close()
    return torch.cat([ids] + [t[:, None] for t in new], dim=1)


@pytest.mark.parametrize("eos", [None, 256])
def test_pipelined_greedy_equals_hf_generate(client, tiny_model, padded_batch, eos):
    ids, mask = padded_batch  # (3, 23): groups of 2 and 1 rows
    got = _pipelined(client, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=256)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=eos, pad_token_id=256)
    assert torch.equal(got, want)


def test_pipelined_group_that_finishes_first_pads_until_the_other_does(client, tiny_model, padded_batch):
    ids, mask = padded_batch
    free = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    T = ids.shape[1]
    eos = int(free[2, T])  # the last row (the second group, alone) stops at once
    assert eos not in free[:2, T:T + 2].tolist()[0]  # ... while the first group goes on
    got = _pipelined(client, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want) and (got[2, T + 1:] == 0).all()


def test_pipelined_survives_a_server_restart(client, server, tiny_model, padded_batch, caplog):
    from splitlearn.client.generation import RemoteDecoder

    ids, mask = padded_batch
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    remote = RemoteDecoder(client.transport, client.segments, 3, "float32", client._local)
    stream = remote.decode(ids, mask, GreedyConfig(max_new_tokens=NEW))
    got = [next(stream) for _ in range(4)]  # both groups' next steps are in flight now
    server.restart()
    with caplog.at_level(logging.WARNING):
        got += list(stream)
    remote.close()
    assert "generation session lost" in caplog.text
    assert torch.equal(torch.cat([ids, torch.stack(got, dim=1)], dim=1), want)


def test_pipelining_is_on_only_where_the_server_has_cores_of_its_own(client, padded_batch, monkeypatch):
    import os

    from splitlearn.client.generation import shares_cores_with_server, use_pipeline

    t = client.transport
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(os.cpu_count() or 1)))
    assert shares_cores_with_server(t.cfg.url)  # loopback, every core: shared
    assert not use_pipeline(t, 3)
    if (os.cpu_count() or 1) >= 2:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # pinned: the server has the others
        assert use_pipeline(t, 3) and use_pipeline(t, 3, u_shape=True)
        assert not use_pipeline(t, 3, u_shape=False)  # 2-way: the client's bottom alone hides nothing
        assert use_pipeline(t, 3, pipeline=True, u_shape=False)  # asked for: done
    assert not use_pipeline(t, 1, pipeline=True)  # one row: nothing to split
    # the client takes the fast path for greedy rows only: sampling and options go to transformers
    ids, mask = padded_batch
    calls = []
    monkeypatch.setattr(type(client), "_hf_generate", lambda self, *a: calls.append(a) or a[0])
    client.generate(ids, mask, max_new_tokens=2, pipeline=True, do_sample=True)
    client.generate(ids, mask, max_new_tokens=2, pipeline=True, num_beams=2)
    assert len(calls) == 2
    out = client.generate(ids, mask, max_new_tokens=2, pipeline=True)  # greedy: the two row groups
    assert len(calls) == 2 and out.shape == (3, ids.shape[1] + 2)


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
