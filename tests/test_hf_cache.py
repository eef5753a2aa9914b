"""RemoteCache and the session cache operations (reorder rows, crop) against real server processes.

One server per shape (U-shape cuts (1, 3): the server holds the trunk; 2-way cut (2,): the top),
two tenants. The servers are never trained, so they hold the seeded init of models/tiny.json,
the ``tiny_model`` fixture's weights. Everything is float32 on the wire: the split model must
give the unsplit model's logits to float32 rounding.
"""
import threading

import pytest
import torch
from transformers import DynamicCache

from splitlearn import partition
from splitlearn.api import protocol as P
from splitlearn.transport import Transport, TransportConfig
from splitlearn.errors import BadRequest, NotFound
from splitlearn.hf.cache import RemoteCache
from splitlearn.model.segments import positions_from_mask
from splitlearn.server.engine.batching import DecodeItem, batched_decode
from splitlearn.server.engine.sessions import CacheOps, Session
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, web

pytestmark = pytest.mark.slow

D, VOCAB, NPOS = 32, 257, 64  # models/tiny.json
MAX_BATCH, MAX_TOKENS = 8, 192  # the servers' --max-batch and --max-tokens-per-client
ATOL = 2e-5


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def server(request, tmp_path_factory):
    from serverproc import ServerProcess

    d = tmp_path_factory.mktemp("hf-cache")
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    extra = ["--token-file", str(d / "tokens"), "--max-batch", str(MAX_BATCH),
             "--max-tokens-per-client", str(MAX_TOKENS)]
    with InprocServerProcess(request.param, extra=extra) as srv:
        srv.cuts = request.param
        srv.u_shape = len(request.param) == 2
        yield srv


@pytest.fixture(scope="module")
def transport(server):
    t = Transport(TransportConfig(server.url, TOKEN))
    yield t
    t.close()


@pytest.fixture(scope="module")
def parts(server, tiny_model):
    return partition(tiny_model, server.cuts)


def remote_cache(server, transport, tiny_model, **kw) -> RemoteCache:
    blocks = server.cuts if server.u_shape else (server.cuts[0], tiny_model.config.n_layer)
    return RemoteCache(tiny_model.config, transport, server_blocks=blocks,
                       server_kind="trunk" if server.u_shape else "top", **kw)


def server_segment(parts):
    return parts.trunk if parts.u_shape else parts.top


def gen(*shape, seed=0, hi=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi, shape, generator=g) if hi else torch.randn(*shape, generator=g)


class _View:
    """A :class:`~splitlearn.model.segments.SegmentCache` over a Cache: a segment reads ``kv`` and the
    length of its first layer."""

    def __init__(self, cache, seg):
        self.kv, self.length = cache, cache.get_seq_length(seg.start)


@torch.no_grad()
def split_logits(parts, cache: RemoteCache, ids, mask):
    """Logits (B, T, V) of the new ``ids`` through the split model: bottom here, the server's
    segment through ``cache.remote``, the top here (U-shape)."""
    h = parts.bottom(ids, mask, _View(cache, parts.bottom))  # (B, T, d)
    if parts.u_shape:
        out = cache.remote(h, mask)  # (B, T, d)
        return parts.top(out, mask, _View(cache, parts.top))
    return cache.remote(h, mask, logits_to_keep=0)  # (B, T, V)


@torch.no_grad()
def full_logits(model, dyn: DynamicCache, ids, mask):
    """The unsplit model on the new ``ids`` with Hugging Face's cache."""
    pos = positions_from_mask(mask, ids.shape[1])
    return model(ids, attention_mask=mask, position_ids=pos, cache=dyn, use_cache=True).logits


class Pair:
    """The split model (RemoteCache) and the unsplit one (DynamicCache), driven alike."""

    def __init__(self, parts, cache, model, mask):
        self.parts, self.cache, self.model = parts, cache, model
        self.dyn = DynamicCache(config=model.config)
        self.mask = mask[:, :0]

    def step(self, ids, new_mask=None):
        new_mask = torch.ones_like(ids) if new_mask is None else new_mask
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        got = split_logits(self.parts, self.cache, ids, self.mask)
        want = full_logits(self.model, self.dyn, ids, self.mask)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=ATOL), float((got - want).abs().max())
        assert self.cache.get_seq_length() == self.dyn.get_seq_length() == self.mask.shape[1]
        return got

    def reorder(self, idx):
        self.cache.reorder_cache(idx)
        self.dyn.reorder_cache(idx)
        self.mask = self.mask[idx]

    def select(self, idx):
        self.cache.batch_select_indices(idx)
        self.dyn.batch_select_indices(idx)
        self.mask = self.mask[idx]

    def repeat(self, k):
        self.cache.batch_repeat_interleave(k)
        self.dyn.batch_repeat_interleave(k)
        self.mask = self.mask.repeat_interleave(k, dim=0)

    def crop(self, k):
        self.cache.crop(-k)
        self.dyn.crop(-k)
        self.mask = self.mask[:, :-k]


# -- (b) the split model with RemoteCache equals the unsplit model with DynamicCache --------------

def test_beam_search_like_reorders_equal_the_unsplit_model(server, transport, parts, tiny_model, padded_batch):
    ids, mask = padded_batch  # (3, 23), left-padded
    with remote_cache(server, transport, tiny_model) as cache:
        pair = Pair(parts, cache, tiny_model, mask)
        pair.step(ids, mask)
        pair.repeat(2)  # 6 rows: two beams per prompt
        for i in range(4):
            pair.step(gen(6, 1, seed=i, hi=VOCAB))
            pair.reorder(gen(6, seed=10 + i, hi=6))  # beam_idx: any rows, repeats allowed
        pair.select(torch.tensor([5, 0, 2]))  # back to 3 rows
        pair.step(gen(3, 1, seed=20, hi=VOCAB))
        pair.select(torch.tensor([True, False, True]))  # a bool mask
        pair.step(gen(2, 2, seed=21, hi=VOCAB))
        steps = cache._step
    assert steps == 7  # one request per step: the operations rode along


def test_speculative_like_crops_equal_the_unsplit_model(server, transport, parts, tiny_model):
    ids = gen(2, 7, seed=1, hi=VOCAB)
    mask = torch.ones_like(ids)
    with remote_cache(server, transport, tiny_model) as cache:
        pair = Pair(parts, cache, tiny_model, mask)
        pair.step(ids)
        pair.step(gen(2, 4, seed=2, hi=VOCAB))  # 4 drafted positions verified at once
        pair.crop(2)  # 2 rejected
        pair.step(gen(2, 3, seed=3, hi=VOCAB))
        pair.crop(3)  # all rejected
        pair.step(gen(2, 1, seed=4, hi=VOCAB))
        pair.crop(1)
        pair.reorder(torch.tensor([1, 1]))  # a crop and a reorder in one step
        pair.step(gen(2, 5, seed=5, hi=VOCAB))
        pair.crop(5)
        pair.crop(2)  # two crops fold into one
        pair.step(gen(2, 2, seed=6, hi=VOCAB))
        assert cache.get_seq_length() == 7 + 4 - 2 + 3 - 3 + 1 - 1 + 5 - 5 - 2 + 2


def test_two_way_answers_the_logits_asked_for(server, transport, parts, tiny_model):
    if server.u_shape:
        pytest.skip("2-way servers answer logits")
    ids = gen(2, 5, seed=7, hi=VOCAB)
    mask = torch.ones_like(ids)
    want = full_logits(tiny_model, DynamicCache(config=tiny_model.config), ids, mask)  # (2, 5, V)
    for keep, shape in ((1, (2, 1, VOCAB)), (3, (2, 3, VOCAB)), (9, (2, 5, VOCAB))):
        with remote_cache(server, transport, tiny_model) as cache:
            h = parts.bottom(ids, mask, _View(cache, parts.bottom))
            out = cache.remote(h, mask) if keep == 1 else cache.remote(h, mask, logits_to_keep=keep)
            assert out.shape == shape and torch.allclose(out, want[:, -shape[1]:], atol=ATOL)
    # the legacy answer of an unnumbered step without 'logits': the last position's, (B, V)
    sid = open_raw(server, 2)
    try:
        h = parts.bottom(ids, mask, None)
        assert answer(post_step(server, sid, {P.HIDDEN: h}, {"position": 0})).shape == (2, VOCAB)
    finally:
        web.delete(server.url + P.SESSION.format(session_id=sid), headers=auth(), timeout=10)


def test_a_lost_session_is_replayed_with_the_operations(server, transport, parts, tiny_model, padded_batch):
    ids, mask = padded_batch
    with remote_cache(server, transport, tiny_model) as cache:
        pair = Pair(parts, cache, tiny_model, mask)
        pair.step(ids, mask)
        pair.step(gen(3, 3, seed=8, hi=VOCAB))
        pair.crop(2)
        pair.reorder(torch.tensor([2, 0, 0]))
        lost = cache.session_id
        transport.delete(P.SESSION.format(session_id=lost))  # expired, or a restart
        pair.step(gen(3, 1, seed=9, hi=VOCAB))  # replays the prompt, reordered and cropped
        assert cache.session_id != lost
        pair.reorder(torch.tensor([1, 2, 0]))
        pair.step(gen(3, 1, seed=10, hi=VOCAB))


def test_close_deletes_the_session_and_gc_too(server, transport, parts, tiny_model):
    ids = gen(1, 3, seed=11, hi=VOCAB)
    cache = remote_cache(server, transport, tiny_model)
    Pair(parts, cache, tiny_model, torch.ones_like(ids)).step(ids)
    sid = cache.session_id
    cache.close()
    with pytest.raises(NotFound):
        transport.delete(P.SESSION.format(session_id=sid))
    cache = remote_cache(server, transport, tiny_model)
    Pair(parts, cache, tiny_model, torch.ones_like(ids)).step(ids)
    sid = cache.session_id
    del cache  # the finalizer deletes it
    import gc
    gc.collect()
    with pytest.raises(NotFound):
        transport.delete(P.SESSION.format(session_id=sid))


def test_concurrent_sessions_with_operations_batch_and_stay_exact(server, transport, parts, tiny_model):
    """Decode steps of sessions whose caches were reordered and cropped share the server's
    forwards (splitlearn/server/engine/batching.py) and still give the unsplit model's logits."""
    before = web.get(server.url + P.INFO, headers=auth(), timeout=10).json()["generation"]

    def run(seed):
        t = Transport(TransportConfig(server.url, TOKEN))
        try:
            ids = gen(2, 6, seed=seed, hi=VOCAB)
            with remote_cache(server, t, tiny_model) as cache:
                pair = Pair(parts, cache, tiny_model, torch.ones_like(ids))
                pair.step(ids)
                for i in range(6):
                    pair.reorder(gen(2, seed=seed + i, hi=2))
                    if i % 2:
                        pair.crop(1)
                    pair.step(gen(2, 1, seed=seed + 50 + i, hi=VOCAB))
        finally:
            t.close()

    errors = []
    threads = [threading.Thread(target=lambda s=s: _catch(errors, run, s)) for s in (100, 200, 300)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    after = web.get(server.url + P.INFO, headers=auth(), timeout=10).json()["generation"]
    assert after["decode_steps"] - before["decode_steps"] == 3 * 6


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(repr(e))


def test_batched_decode_of_reordered_and_cropped_caches_equals_each_alone(parts):
    """In process: the batcher's shared forward over caches changed by CacheOps."""
    seg = server_segment(parts)
    seg.eval()

    def session(rows, seed):
        s = Session(f"s{seed}", "owner", rows, seg.new_cache())
        with torch.no_grad():
            seg(gen(rows, 5, D, seed=seed), None, s.cache)
        return s

    ops = [CacheOps(torch.tensor([1, 1, 0]), 3), CacheOps(torch.tensor([0, 0, 0, 1]), None), CacheOps(None, 2)]
    alone, together = [session(2, i) for i in range(3)], [session(2, i) for i in range(3)]
    for s, a, op in zip(together, alone, ops):
        op.apply(s)
        op.apply(a)
    x = [gen(s.rows, 1, D, seed=40 + i) for i, s in enumerate(together)]
    outs = batched_decode(seg, [DecodeItem(s.cache, h) for s, h in zip(together, x)])
    for s, h, out in zip(alone, x, outs):
        with torch.no_grad():
            want = seg(h, None, s.cache)
        assert torch.allclose(out, want, atol=1e-5)


# -- (a) the server's operations equal the same operations on a local cache of its segment -------

class LocalSegment:
    """The server's segment in this process, with a SegmentCache whose DynamicCache gets the
    same operations through Hugging Face's API: the expected answers."""

    def __init__(self, parts, rows):
        self.seg = server_segment(parts)
        self.cache = self.seg.new_cache()
        self.mask = torch.zeros(rows, 0, dtype=torch.long)

    @torch.no_grad()
    def __call__(self, h, new_mask):
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        return self.seg(h, self.mask, self.cache, logits_to_keep=1 if self.seg.has_head else 0)[:, -1] \
            if self.seg.has_head else self.seg(h, self.mask, self.cache)

    def reorder(self, idx):
        self.cache.kv.reorder_cache(idx)
        self.mask = self.mask[idx]

    def crop(self, n):
        self.cache.kv.crop(-(self.cache.length - n))
        self.cache.length = n
        self.mask = self.mask[:, :n]


def post_step(server, sid, tensors, meta, token=TOKEN):
    body = encode(tensors, {k: str(v) for k, v in meta.items()})
    return web.post(server.url + P.SESSION_STEP.format(session_id=sid), data=body, timeout=30,
                    headers={**auth(token), "Content-Type": P.CONTENT_TYPE})


def answer(resp):
    assert resp.status_code == 200, resp.text
    t = decode(resp.content)[0]
    return t[P.HIDDEN] if P.HIDDEN in t else t[P.LOGITS]


def open_raw(server, rows, token=TOKEN):
    r = web.post(server.url + P.SESSIONS, json={"rows": rows}, headers=auth(token), timeout=10)
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def test_operations_on_the_server_equal_hf_operations_on_its_segment(server, parts):
    local = LocalSegment(parts, 3)
    sid = open_raw(server, 3)
    try:
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 1, 1, 1, 1, 1]])
        h = gen(3, 6, D, seed=1)
        assert torch.allclose(answer(post_step(server, sid, {P.HIDDEN: h, P.MASK: mask}, {"position": 0, "step": 1})),
                              local(h, mask), atol=1e-5)
        # reorder to 4 rows and crop to 4 positions, then 2 new positions: one request
        idx, h = torch.tensor([2, 0, 0, 1]), gen(4, 2, D, seed=2)
        ones = torch.ones(4, 2, dtype=torch.long)
        step2 = {P.HIDDEN: h, P.MASK: ones, P.REORDER: idx}
        meta2 = {"position": 4, "crop": 4, "step": 2}
        r = post_step(server, sid, step2, meta2)
        local.reorder(idx)
        local.crop(4)
        want = local(h, ones)
        assert torch.allclose(answer(r), want, atol=1e-5)
        # the same step again (a transport retry): the stored answer, the cache untouched
        again = post_step(server, sid, step2, meta2)
        assert again.status_code == 200 and again.content == r.content
        h = gen(4, 1, D, seed=3)
        out = answer(post_step(server, sid, {P.HIDDEN: h}, {"position": 6, "step": 3}))
        assert torch.allclose(out, local(h, torch.ones(4, 1, dtype=torch.long)), atol=1e-5)
        # select 1 row and crop everything: the session starts over with one row
        h = gen(1, 3, D, seed=4)
        out = answer(post_step(server, sid, {P.HIDDEN: h, P.REORDER: torch.tensor([3])},
                               {"position": 0, "crop": 0, "step": 4}))
        local.reorder(torch.tensor([3]))
        local.crop(0)
        assert torch.allclose(out, local(h, torch.ones(1, 3, dtype=torch.long)), atol=1e-5)
    finally:
        web.delete(server.url + P.SESSION.format(session_id=sid), headers=auth(), timeout=10)


# -- (c) hostile requests: 4xx JSON, nothing changed ------------------------------------------

def assert_refused(resp, status, words=""):
    assert resp.status_code == status, (resp.status_code, resp.text)
    payload = resp.json()
    assert set(payload) == {"error", "message"}
    assert words.lower() in payload["message"].lower(), payload
    return payload


def test_hostile_operations_are_refused_and_change_nothing(server, transport, parts, tiny_model, padded_batch):
    ids, mask = padded_batch  # 3 rows
    with remote_cache(server, transport, tiny_model) as cache:
        pair = Pair(parts, cache, tiny_model, mask)
        pair.step(ids, mask)
        pair.step(gen(3, 1, seed=30, hi=VOCAB))
        sid, length, nxt = cache.session_id, cache.get_seq_length(), cache._step + 1
        h = lambda rows, T=1: gen(rows, T, D, seed=31)  # noqa: E731
        meta = {"position": length, "step": nxt}
        bad = [  # (tensors, meta, status, words)
            ({P.HIDDEN: h(2), P.REORDER: torch.tensor([0, 3])}, meta, 400, "outside [0, 3)"),
            ({P.HIDDEN: h(2), P.REORDER: torch.tensor([0, -1])}, meta, 400, "outside"),
            ({P.HIDDEN: h(9), P.REORDER: torch.zeros(9, dtype=torch.long)}, meta, 400, "1 <= R <= 8"),
            ({P.HIDDEN: h(1), P.REORDER: torch.tensor([2 ** 62])}, meta, 400, "outside"),
            ({P.HIDDEN: h(2), P.REORDER: torch.tensor([0.0, 1.0])}, meta, 400, "int64"),
            ({P.HIDDEN: h(2), P.REORDER: torch.tensor([[0, 1]])}, meta, 400, "shape [R]"),
            ({P.HIDDEN: h(1), P.REORDER: torch.zeros(0, dtype=torch.long)}, meta, 400, "shape [R]"),
            ({P.HIDDEN: h(2), P.REORDER: torch.tensor([0, 1, 2])}, meta, 400, "rows, expected 3"),
            ({P.HIDDEN: h(3)}, {**meta, "position": length + 1, "crop": length + 1}, 400, "crop="),
            ({P.HIDDEN: h(3)}, {**meta, "position": 2, "crop": 3}, 400, "position must be 3"),
            ({P.HIDDEN: h(3)}, {**meta, "position": 2, "crop": -1}, 400, ">= 0"),
            ({P.HIDDEN: h(3)}, {**meta, "crop": "9" * 400}, 400, "too long"),
            ({P.HIDDEN: h(3)}, {**meta, "step": "9" * 25}, 400, "too long"),
            ({P.HIDDEN: h(3)}, {**meta, "step": 0}, 400, ">= 1"),
            ({P.HIDDEN: h(3)}, {"position": 2, "crop": 2}, 400, "numbered"),
            ({P.HIDDEN: h(3)}, {**meta, "step": nxt + 1}, 409, f"expected {nxt}"),
            ({P.HIDDEN: h(3)}, {**meta, "step": nxt - 2}, 409, f"expected {nxt}"),
            ({P.HIDDEN: h(3)}, {**meta, "position": length - 1}, 409, f"has seen {length}"),
            ({P.HIDDEN: h(3)}, {**meta, "logits": "x"}, 400, "integer"),
            # 8 rows x (length + 1) cached tokens pass this tenant's limit
            ({P.HIDDEN: h(8), P.REORDER: torch.zeros(8, dtype=torch.long)}, meta, 429, "limit of"),
        ]
        if server.u_shape:
            bad.append(({P.HIDDEN: h(3)}, {**meta, "logits": 0}, 400, "2-way"))
        if length * 8 + 8 <= MAX_TOKENS:
            pytest.fail("the prompt is too short for the token limit case")
        for tensors, m, status, words in bad:
            assert_refused(post_step(server, sid, tensors, m), status, words)
        # the last step's number again: its stored answer, whatever the body says
        last = post_step(server, sid, {P.HIDDEN: h(3)}, {**meta, "step": nxt - 1})
        assert last.status_code == 200 and answer(last).shape[:2] == (3, 1)
        # another tenant: the session does not exist for it
        assert_refused(post_step(server, sid, {P.HIDDEN: h(3)}, meta, token=OTHER), 404, "no generation session")
        r = web.delete(server.url + P.SESSION.format(session_id=sid), headers=auth(OTHER), timeout=10)
        assert_refused(r, 404)
        # the session is intact: the next steps equal the unsplit model
        pair.reorder(torch.tensor([2, 2, 1]))
        pair.crop(1)
        pair.step(gen(3, 2, seed=32, hi=VOCAB))


def test_client_side_checks(server, transport, tiny_model, parts):
    with remote_cache(server, transport, tiny_model) as cache:
        ids = gen(2, 3, seed=40, hi=VOCAB)
        Pair(parts, cache, tiny_model, torch.ones_like(ids)).step(ids)
        with pytest.raises(ValueError, match="indices"):
            cache.reorder_cache(torch.tensor([0, 2]))
        with pytest.raises(ValueError, match="holds 3 positions"):
            cache.crop(-4)
        with pytest.raises(ValueError, match="repeats"):
            cache.batch_repeat_interleave(0)
        with pytest.raises(ValueError, match="past \\+ T"):
            cache.remote(gen(2, 1, D), torch.ones(2, 2, dtype=torch.long))
        cache.crop(5)  # transformers 4's crop(max_length): nothing beyond 3 to drop
        assert cache.get_seq_length() == 3
        cache.crop(2)
        assert cache.get_seq_length() == 2 and not cache.is_compileable and cache.is_croppable


# transformers' own generate() through RemoteCache (made by generate itself, every strategy,
# assisted decoding in both shapes): tests/test_hf_generation.py

# -- in process: the metadata, and cached-token accounting after the operations ------------------

def test_session_step_meta_carries_the_operations():
    m = P.SessionStepMeta(18, "float32", step=9, crop=18, logits=4)
    meta = m.to_meta()
    assert meta == {"position": "18", "wire_dtype": "float32", "step": "9", "crop": "18", "logits": "4"}
    assert P.SessionStepMeta.from_meta(meta) == m
    assert P.SessionStepMeta(3).to_meta() == {"position": "3", "wire_dtype": "float32"}  # as before
    for bad in ({"position": "1", "step": "0"}, {"position": "1", "crop": "-2"}, {"position": "1", "logits": "-1"},
                {"position": "1" * 21}):
        with pytest.raises(BadRequest):
            P.SessionStepMeta.from_meta(bad)


def test_cached_tokens_are_counted_after_crop_and_reorder():
    from serverproc import post_tensors
    from splitlearn.server.http.app import create_app
    from splitlearn.server.config import ServerConfig

    client = create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, max_tokens_per_client=24)).test_client()
    sid = client.post(P.SESSIONS, json={"rows": 2}, headers=auth()).get_json()["session_id"]
    path = P.SESSION_STEP.format(session_id=sid)

    def step(rows, T, **meta):
        return post_tensors(client, path, {P.HIDDEN: gen(rows, T, D), **meta.pop("t", {})},
                            {k: str(v) for k, v in meta.items()})

    assert step(2, 10, position=0, step=1).status_code == 200  # 20 cached tokens
    r = step(2, 4, position=10, step=2)  # 28 > 24
    assert r.status_code == 429 and "limit of 24" in r.get_json()["message"]
    assert step(2, 4, position=6, crop=6, step=2).status_code == 200  # 2 x (6 + 4) = 20
    r = step(3, 1, position=10, step=3, t={P.REORDER: torch.tensor([0, 1, 1])})  # 3 x 11 = 33
    assert r.status_code == 429
    assert step(1, 1, position=10, step=3, t={P.REORDER: torch.tensor([1])}).status_code == 200  # 1 x 11
    assert step(2, 1, position=11, step=4, t={P.REORDER: torch.tensor([0, 0])}).status_code == 200  # 2 x 12
    assert step(2, 1, position=12, step=5).status_code == 429  # 26
