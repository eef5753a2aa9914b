"""Generation sessions on the server (splitlearn.server.engine.sessions through the app's test client).

A session step carries the hidden states of the new positions and the attention mask of those
new positions only; the server keeps the KV cache and the mask of everything before. Its
answers must equal the same segment run locally with a cache.
"""
import pytest
import torch

from splitlearn import partition
from splitlearn.api import protocol as P
from splitlearn.server.http.app import create_app
from splitlearn.server.config import ServerConfig

from serverproc import TENANTS, OTHER, TOKEN, assert_error, auth, post_tensors, tensors_of

D, NPOS, VOCAB = 32, 64, 257  # models/tiny.json
PREFILL_MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # (2, 5), row 0 left-padded


def make_app(cuts=(1, 3), **limits):
    return create_app(ServerConfig(model="tiny", cuts=cuts, tokens=TENANTS, **limits))


@pytest.fixture
def u():
    return make_app().test_client()


def hidden(B=2, T=5, seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))  # (B, T, d)


def open_session(client, rows=2, token=TOKEN):
    r = client.post(P.SESSIONS, json={"rows": rows}, headers=auth(token))
    assert r.status_code == 201, r.get_data(as_text=True)
    assert r.get_json()["rows"] == rows
    return r.get_json()["session_id"]


def step(client, sid, h, mask, position, token=TOKEN):
    tensors = {P.HIDDEN: h} if mask is None else {P.HIDDEN: h, P.MASK: mask}
    return post_tensors(client, P.SESSION_STEP.format(session_id=sid), tensors,
                        P.SessionStepMeta(position).to_meta(), token=token)


class LocalSegment:
    """The server's segment run in this process with its own cache: the expected answers."""

    def __init__(self, model, cuts):
        parts = partition(model, cuts)
        self.seg = parts.trunk if parts.u_shape else parts.top
        self.cache = self.seg.new_cache()
        self.mask = torch.zeros(2, 0, dtype=torch.long)

    @torch.no_grad()
    def __call__(self, h, new_mask):
        self.mask = torch.cat([self.mask, new_mask], dim=1)  # (B, past + T)
        out = self.seg(h, self.mask, self.cache)
        return out if self.seg.kind == "trunk" else out[:, -1, :]


@pytest.mark.parametrize("cuts, name, shape", [((1, 3), P.HIDDEN, (2, 5, D)), ((2,), P.LOGITS, (2, VOCAB))])
def test_session_steps_equal_the_segment_run_locally(tiny_model, cuts, name, shape):
    client = make_app(cuts).test_client()
    local = LocalSegment(tiny_model, cuts)
    sid = open_session(client)
    out = tensors_of(step(client, sid, hidden(), PREFILL_MASK, 0))[name]  # prefill
    assert out.shape == shape
    assert torch.allclose(out, local(hidden(), PREFILL_MASK), atol=1e-6)
    for i, position in enumerate((5, 6, 7)):  # decode: one position each, padding remembered
        h, ones = hidden(2, 1, seed=i + 1), torch.ones(2, 1, dtype=torch.long)
        out = tensors_of(step(client, sid, h, ones, position))[name]
        assert torch.allclose(out, local(h, ones), atol=1e-6), position


def test_wrong_position_is_409_and_the_cache_is_unchanged(u, tiny_model):
    local = LocalSegment(tiny_model, (1, 3))
    sid = open_session(u)
    tensors_of(step(u, sid, hidden(), PREFILL_MASK, 0))
    local(hidden(), PREFILL_MASK)
    h, ones = hidden(2, 1, seed=1), torch.ones(2, 1, dtype=torch.long)
    for wrong in (0, 4, 6):
        assert_error(step(u, sid, h, ones, wrong), 409, "has seen 5 positions")
    assert_error(step(u, sid, hidden(2, 1).mul(float("nan")), ones, 5), 400, "NaN")
    assert_error(step(u, sid, hidden(3, 1), torch.ones(3, 1, dtype=torch.long), 5), 400, "rows")
    assert_error(step(u, sid, hidden(2, NPOS - 4), None, 5), 400, "max_position_embeddings")
    out = tensors_of(step(u, sid, h, ones, 5))[P.HIDDEN]
    assert torch.allclose(out, local(h, ones), atol=1e-6)


def test_sessions_are_private_to_their_token(u):
    mine = open_session(u, token=TOKEN)
    h, mask = hidden(), PREFILL_MASK
    assert_error(step(u, "no-such-session", h, mask, 0), 404, "no-such-session")
    payload = assert_error(step(u, mine, h, mask, 0, token=OTHER), 404, "no generation session")
    assert payload["error"] == "not_found"
    assert_error(u.delete(P.SESSION.format(session_id=mine), headers=auth(OTHER)), 404)
    assert tensors_of(step(u, mine, h, mask, 0))[P.HIDDEN].shape == (2, 5, D)  # still mine, intact


def test_closing_a_session_frees_it_and_leaves_others_alone(u, tiny_model):
    local = LocalSegment(tiny_model, (1, 3))
    keep, gone = open_session(u), open_session(u)
    for sid in (keep, gone):
        tensors_of(step(u, sid, hidden(), PREFILL_MASK, 0))
    local(hidden(), PREFILL_MASK)
    r = u.delete(P.SESSION.format(session_id=gone), headers=auth())
    assert r.status_code == 204 and r.get_data() == b""
    assert_error(step(u, gone, hidden(2, 1), torch.ones(2, 1, dtype=torch.long), 5), 404)
    assert_error(u.delete(P.SESSION.format(session_id=gone), headers=auth()), 404)
    h, ones = hidden(2, 1, seed=3), torch.ones(2, 1, dtype=torch.long)
    out = tensors_of(step(u, keep, h, ones, 5))[P.HIDDEN]
    assert torch.allclose(out, local(h, ones), atol=1e-6)


def test_cached_tokens_over_the_limit_is_429_with_retry_after(tiny_model):
    client = make_app(max_tokens_per_client=24, session_ttl_s=120).test_client()
    local = LocalSegment(tiny_model, (1, 3))
    sid = open_session(client)  # 2 rows
    tensors_of(step(client, sid, hidden(), PREFILL_MASK, 0))  # 10 cached tokens
    local(hidden(), PREFILL_MASK)
    other = open_session(client)
    tensors_of(step(client, other, hidden(2, 4), None, 0))  # 8 more: 18 of 24
    r = step(client, sid, hidden(2, 4), None, 5)  # 8 more would make 26
    payload = assert_error(r, 429, "limit of 24")
    assert payload["error"] == "too_many_requests" and r.headers["Retry-After"] == "120"
    # another token holder has its own budget
    theirs = open_session(client, token=OTHER)
    assert tensors_of(step(client, theirs, hidden(2, 4), None, 0, token=OTHER))
    # the refused step changed nothing: the session goes on at position 5
    h, ones = hidden(2, 1, seed=4), torch.ones(2, 1, dtype=torch.long)
    assert torch.allclose(tensors_of(step(client, sid, h, ones, 5))[P.HIDDEN], local(h, ones), atol=1e-6)
    client.delete(P.SESSION.format(session_id=other), headers=auth())
    assert tensors_of(step(client, sid, hidden(2, 3), None, 6))  # room again after closing one


def test_too_many_sessions_is_503_with_retry_after():
    client = make_app(max_sessions=2).test_client()
    first, _ = open_session(client), open_session(client, token=OTHER)
    r = client.post(P.SESSIONS, json={"rows": 1}, headers=auth())
    assert assert_error(r, 503, "maximum of 2")["error"] == "unavailable"
    assert int(r.headers["Retry-After"]) >= 1
    assert client.delete(P.SESSION.format(session_id=first), headers=auth()).status_code == 204
    open_session(client)


@pytest.mark.parametrize("payload", [{"rows": 0}, {"rows": 65}, {"rows": "2"}, {"rows": True},
                                     {"rows": 1.5}])
def test_bad_rows_are_refused(u, payload):
    assert_error(u.post(P.SESSIONS, json=payload, headers=auth()), 400, "rows")


def test_sessions_need_a_token(u):
    assert_error(u.post(P.SESSIONS, json={"rows": 1}), 401)
