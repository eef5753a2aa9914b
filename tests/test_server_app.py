"""splitlearn.server.http.app through Flask's test client: auth, refused requests, exactly-once steps.

Every refused request must answer a 4xx JSON error naming the problem, leave the segment's
weights bit-for-bit unchanged, and leave the server answering.
"""
import io
import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.server.http.app import create_app
from splitlearn.server.config import ServerConfig
from splitlearn.api.wire import encode, pack

from serverproc import (TENANTS, OTHER, TOKEN, apply_step, assert_error, auth, post_tensors, same_weights,
                        segment_of, snapshot, tensors_of)

D, NPOS, VOCAB = 32, 64, 257  # models/tiny.json


@pytest.fixture
def u_app():
    return create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS))


@pytest.fixture
def two_way_app():
    return create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS))


@pytest.fixture
def u(u_app):
    return u_app.test_client()


@pytest.fixture
def two_way(two_way_app):
    return two_way_app.test_client()


def hidden(B=2, T=6, seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))  # (B, T, d)


def step_body(step=1, client="c1", B=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    tensors = {P.HIDDEN: hidden(B, T, seed), P.LABELS: torch.randint(0, VOCAB, (B, T), generator=g)}
    return tensors, P.StepMeta(client, step).to_meta()


def test_health_needs_no_token_and_info_describes_the_segment(u, two_way):
    r = u.get(P.HEALTH)
    assert r.status_code == 200 and r.get_json()["protocol_version"] == P.PROTOCOL_VERSION
    info = u.get(P.INFO, headers=auth()).get_json()
    assert info["cuts"] == [1, 3] and info["shape"] == "u" and info["segment"]["blocks"] == [1, 3]
    assert not info["labels_leave_client"]
    info = two_way.get(P.INFO, headers=auth(OTHER)).get_json()  # every configured token works
    assert info["shape"] == "2-way" and info["segment"] == {"kind": "top", "blocks": [2, 4]}


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": "tok"}, {"Authorization": "Basic tok"},
    {"Authorization": "Bearer "}, {"Authorization": "Bearer tokx"},
], ids=["none", "wrong", "no-scheme", "basic", "empty", "prefix"])
def test_missing_or_wrong_token_is_401(two_way_app, two_way, headers):
    before = snapshot(segment_of(two_way_app))
    assert_error(two_way.get(P.INFO, headers=headers), 401, "bearer token")
    tensors, meta = step_body()
    r = two_way.post(P.TRAIN_STEP, data=encode(tensors, meta),
                     headers={**headers, "Content-Type": P.CONTENT_TYPE})
    assert assert_error(r, 401)["error"] == "unauthorized"
    assert_error(two_way.get("/v1/nowhere", headers=headers), 401)  # no route probing without a token
    assert same_weights(before, snapshot(segment_of(two_way_app)))
    assert two_way.get(P.CLIENT_STATE.format(client_id="c1"), headers=auth()).get_json()["step"] == 0


def _nan():
    h = hidden()
    h[1, 2, 3] = float("nan")
    return h


def _inf():
    h = hidden()
    h[0, 0, 0] = float("inf")
    return h


def _with(**changes):
    """A valid step-1 body with some tensors replaced (None removes one)."""
    tensors, meta = step_body()
    for k, v in changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    return tensors, meta


GOOD = encode(*step_body())

BAD_STEPS = {  # name: (tensors, meta, raw body or None, content type, status, words)
    "not-safetensors": ({}, {}, b"hello, I am not tensors at all", P.CONTENT_TYPE, 400, "not safetensors"),
    "truncated": ({}, {}, GOOD[:-7], P.CONTENT_TYPE, 400, "safetensors"),
    "empty": ({}, {}, b"", P.CONTENT_TYPE, 400, "0 bytes"),
    "no-hidden": (*_with(hidden=None), None, P.CONTENT_TYPE, 400, "'hidden'"),
    "no-labels": (*_with(labels=None), None, P.CONTENT_TYPE, 400, "'labels'"),
    "wrong-width": (*_with(hidden=torch.zeros(2, 6, 16)), None, P.CONTENT_TYPE, 400, "shape"),
    "2d-hidden": (*_with(hidden=torch.zeros(6, D)), None, P.CONTENT_TYPE, 400, "shape"),
    "int64-hidden": (*_with(hidden=torch.zeros(2, 6, D, dtype=torch.int64)), None, P.CONTENT_TYPE,
                     400, "int64"),
    "float64-hidden": (*_with(hidden=torch.zeros(2, 6, D, dtype=torch.float64)), None,
                       P.CONTENT_TYPE, 400, "float64"),
    "int8-no-scale": (*_with(hidden=pack("h", hidden(), "int8")["h"]), None, P.CONTENT_TYPE, 400,
                      "hidden.scale"),
    "nan": (*_with(hidden=_nan()), None, P.CONTENT_TYPE, 400, "NaN"),
    "inf": (*_with(hidden=_inf()), None, P.CONTENT_TYPE, 400, "inf"),
    "too-long": ({P.HIDDEN: hidden(1, NPOS + 1), P.LABELS: torch.zeros(1, NPOS + 1, dtype=torch.long)},
                 P.StepMeta("c1", 1).to_meta(), None, P.CONTENT_TYPE, 400, "max_position_embeddings"),
    "labels-shape": (*_with(labels=torch.zeros(2, 5, dtype=torch.long)), None, P.CONTENT_TYPE, 400,
                     "labels"),
    "labels-range": (*_with(labels=torch.full((2, 6), VOCAB)), None, P.CONTENT_TYPE, 400, "labels"),
    "labels-float": (*_with(labels=torch.zeros(2, 6)), None, P.CONTENT_TYPE, 400, "labels"),
    "mask-not-01": (*_with(attention_mask=torch.full((2, 6), 2)), None, P.CONTENT_TYPE, 400, "0 and 1"),
    "closed-step": (step_body()[0], {**step_body()[1], "micros": "1"}, None, P.CONTENT_TYPE, 400,
                    "closed training steps (micros >= 1) are gone: send micros=0"),
    "micros-absent": (step_body()[0], {"client_id": "c1", "step": "1"}, None, P.CONTENT_TYPE, 400,
                      "closed training steps"),
    "mask-shape": (*_with(attention_mask=torch.ones(2, 7, dtype=torch.long)), None, P.CONTENT_TYPE,
                   400, "attention_mask"),
    "no-client-id": (step_body()[0], {"step": "1"}, None, P.CONTENT_TYPE, 400, "client_id"),
    "bad-step": (step_body()[0], {"client_id": "c1", "step": "zero", "micros": "0"}, None, P.CONTENT_TYPE, 400,
                 "step"),
    "bad-wire": (step_body()[0], {"client_id": "c1", "step": "1", "micros": "0", "wire_dtype": "fp8"}, None,
                 P.CONTENT_TYPE, 400, "wire dtype"),
    "text-content-type": (*step_body(), None, "text/plain", 415, "application/octet-stream"),
    "form-content-type": (*step_body(), None, "application/x-www-form-urlencoded", 415, "octet-stream"),
    "no-content-type": (*step_body(), None, None, 415, "no content type"),
}


@pytest.mark.parametrize("name", BAD_STEPS)
def test_bad_train_step_is_refused_and_changes_nothing(two_way_app, two_way, name):
    tensors, meta, raw, ctype, status, words = BAD_STEPS[name]
    before = snapshot(segment_of(two_way_app))
    r = post_tensors(two_way, P.TRAIN_STEP, tensors, meta, data=raw, content_type=ctype)
    assert_error(r, status, words)
    assert same_weights(before, snapshot(segment_of(two_way_app)))
    assert two_way.get(P.HEALTH).status_code == 200
    assert two_way.get(P.CLIENT_STATE.format(client_id="c1"), headers=auth()).get_json()["step"] == 0
    # and the server still takes the next good request as step 1
    assert P.GRAD in tensors_of(post_tensors(two_way, P.TRAIN_STEP, *step_body()))


@pytest.mark.parametrize("path, method, status", [
    ("/v1/nowhere", "get", 404), ("/v2/train/step", "post", 404), (P.TRAIN_STEP, "get", 405),
    (P.HEALTH, "post", 405),
])
def test_unknown_route_or_method_is_a_json_error(two_way, path, method, status):
    r = getattr(two_way, method)(path, headers=auth())
    payload = assert_error(r, status)
    if status == 404:
        assert path in payload["message"] and payload["error"] == "not_found"


def test_body_over_the_limit_is_413_unread():
    app = create_app(ServerConfig(model="tiny", cuts=(2,), tokens=(TOKEN,), max_body_bytes=2048))
    client = app.test_client()
    before = snapshot(segment_of(app))
    tensors, meta = step_body(T=10)  # 2 x 10 x 32 float32 = 2560 bytes of hidden alone
    assert len(encode(tensors, meta)) > 2048
    r = post_tensors(client, P.TRAIN_STEP, tensors, meta)
    assert_error(r, 413, "too large")
    assert same_weights(before, snapshot(segment_of(app)))
    assert client.get(P.HEALTH).status_code == 200
    assert P.GRAD in tensors_of(post_tensors(client, P.TRAIN_STEP, *step_body(T=3)))  # small fits


def test_bad_u_shape_requests_change_nothing(u_app, u):
    before = snapshot(segment_of(u_app))
    meta = P.StepMeta("c1", 1).to_meta()
    assert_error(post_tensors(u, P.TRAIN_FORWARD, {P.HIDDEN: _nan()}, meta), 400, "NaN")
    assert_error(post_tensors(u, P.TRAIN_FORWARD, {"h": hidden()}, meta), 400, "'hidden'")
    assert_error(post_tensors(u, P.TRAIN_STEP, *step_body()), 400, "2-way")  # wrong shape of split
    assert_error(post_tensors(u, P.FORWARD, {P.HIDDEN: hidden(1, NPOS + 1)}, {}), 400, "max_position_embeddings")
    # a grad that does not match the pending forward
    assert tensors_of(post_tensors(u, P.TRAIN_FORWARD, {P.HIDDEN: hidden()}, meta))
    assert_error(post_tensors(u, P.TRAIN_BACKWARD, {P.GRAD: hidden(2, 5)}, meta), 400, "shape")
    assert_error(post_tensors(u, P.TRAIN_BACKWARD, {P.GRAD: _inf()}, meta), 400, "inf")
    assert same_weights(before, snapshot(segment_of(u_app)))
    assert u.get(P.HEALTH).status_code == 200


# -- exactly-once training steps ----------------------------------------------------------

def _client_step(client, cid="c1"):
    return client.get(P.CLIENT_STATE.format(client_id=cid), headers=auth()).get_json()["step"]


def test_two_way_steps_apply_exactly_once(two_way_app, two_way):
    seg = segment_of(two_way_app)
    w0 = snapshot(seg)
    first = post_tensors(two_way, P.TRAIN_STEP, *step_body(1))
    out = tensors_of(first)
    assert out[P.GRAD].shape == (2, 6, D) and torch.isfinite(out[P.LOSS]).all()
    assert post_tensors(two_way, P.TRAIN_STEP, *step_body(1)).get_data() == first.get_data()  # a retry
    assert same_weights(w0, snapshot(seg))  # accumulated: nothing applied before the apply
    applied = apply_step(two_way, "c1", 1)
    assert applied.status_code == 200 and applied.get_json()["applied"]
    w1 = snapshot(seg)
    assert not same_weights(w0, w1)  # step 1 was applied

    assert apply_step(two_way, "c1", 1).get_json() == applied.get_json()  # a retried apply: its answer
    assert_error(post_tensors(two_way, P.TRAIN_STEP, *step_body(1)), 409, "was applied")  # a retried piece
    assert same_weights(w1, snapshot(seg))  # ...and no retry stepped again

    assert_error(post_tensors(two_way, P.TRAIN_STEP, *step_body(3)), 409, "next is 2")
    assert same_weights(w1, snapshot(seg))
    tensors_of(post_tensors(two_way, P.TRAIN_STEP, *step_body(2, seed=1)))
    assert apply_step(two_way, "c1", 2).status_code == 200
    w2 = snapshot(seg)
    assert_error(post_tensors(two_way, P.TRAIN_STEP, *step_body(1)), 409, "applied step 2")  # stale
    assert same_weights(w2, snapshot(seg))
    assert _client_step(two_way) == 2
    # another client counts its own steps
    assert _client_step(two_way, "c2") == 0
    tensors_of(post_tensors(two_way, P.TRAIN_STEP, *step_body(1, client="c2")))
    assert apply_step(two_way, "c2", 1).status_code == 200
    assert _client_step(two_way, "c2") == 1 and _client_step(two_way) == 2


def test_a_closed_step_is_refused_and_changes_nothing(u_app, u, two_way_app, two_way):
    """Closed steps (micros >= 1, or micros absent: the server applied at its own lr after the
    last piece) are gone: 400 naming the way (micros=0 and an apply), nothing pending or applied."""
    for app, client, path, tensors in ((u_app, u, P.TRAIN_FORWARD, {P.HIDDEN: hidden()}),
                                       (two_way_app, two_way, P.TRAIN_STEP, step_body()[0])):
        before = snapshot(segment_of(app))
        for micros in ("1", "4", None):
            meta = {**P.StepMeta("c1", 1).to_meta(), "micros": micros}
            if micros is None:
                meta.pop("micros")
            r = post_tensors(client, path, tensors, meta)
            assert_error(r, 400, "closed training steps (micros >= 1) are gone: send micros=0")
            assert "apply" in r.get_json()["message"]
        assert_error(post_tensors(client, P.TRAIN_BACKWARD, {P.GRAD: hidden()}, {**P.StepMeta("c1", 1).to_meta(),
                                                                                 "micros": "1"}), 400, "closed")
        assert same_weights(before, snapshot(segment_of(app)))
        rt = app.extensions["splitlearn"]
        assert rt.ledger.pending("t:c1") is None and rt.ledger.pending("alice:c1") is None
        assert _client_step(client) == 0
        assert_error(apply_step(client, "c1", 1), 409, "no step 1 is pending")  # nothing was opened
        # and the same step as an open-ended one goes through
        tensors_of(post_tensors(client, path, tensors, P.StepMeta("c1", 1).to_meta()))


def test_u_shape_steps_apply_exactly_once(u_app, u):
    seg = segment_of(u_app)
    w0 = snapshot(seg)
    meta1 = P.StepMeta("c1", 1).to_meta()
    grad = {P.GRAD: hidden(seed=5)}
    assert_error(post_tensors(u, P.TRAIN_BACKWARD, grad, meta1), 409, "forward")  # no forward yet
    assert same_weights(w0, snapshot(seg))

    fwd = post_tensors(u, P.TRAIN_FORWARD, {P.HIDDEN: hidden()}, meta1)
    assert tensors_of(fwd)[P.HIDDEN].shape == (2, 6, D)
    assert post_tensors(u, P.TRAIN_FORWARD, {P.HIDDEN: hidden()}, meta1).get_data() == fwd.get_data()
    assert same_weights(w0, snapshot(seg))  # a forward alone changes nothing

    bwd = post_tensors(u, P.TRAIN_BACKWARD, grad, meta1)
    assert tensors_of(bwd)[P.GRAD].shape == (2, 6, D)
    assert post_tensors(u, P.TRAIN_BACKWARD, grad, meta1).get_data() == bwd.get_data()  # retry
    assert same_weights(w0, snapshot(seg))  # accumulated until the apply
    assert apply_step(u, "c1", 1).status_code == 200
    w1 = snapshot(seg)
    assert not same_weights(w0, w1)
    assert_error(post_tensors(u, P.TRAIN_BACKWARD, grad, meta1), 409, "was applied")  # a retry after it
    assert same_weights(w1, snapshot(seg))
    assert_error(post_tensors(u, P.TRAIN_FORWARD, {P.HIDDEN: hidden()}, P.StepMeta("c1", 3).to_meta()),
                 409, "next is 2")
    assert_error(post_tensors(u, P.TRAIN_BACKWARD, grad, P.StepMeta("c1", 2).to_meta()), 409, "forward")
    assert same_weights(w1, snapshot(seg))
    assert _client_step(u) == 1


def test_checkpoint_without_a_directory_is_refused(u):
    assert_error(u.post(P.CHECKPOINT, json={}, headers=auth()), 400, "--checkpoint-dir")


def test_evaluation_forward_changes_nothing(two_way_app, two_way):
    before = snapshot(segment_of(two_way_app))
    tensors, _ = step_body()
    out = tensors_of(post_tensors(two_way, P.FORWARD, tensors, {"wire_dtype": "bfloat16"}))
    assert out[P.LOGITS].shape == (2, VOCAB) and out[P.LOGITS].dtype == torch.bfloat16
    assert torch.isfinite(out[P.LOSS]).all()
    assert same_weights(before, snapshot(segment_of(two_way_app)))


def test_a_retry_after_a_restart_gets_the_stored_answer(tmp_path):
    """The step was applied and checkpointed, the answer lost with the process: the client's
    retry of that step must get the same answer, not 409 (it could never catch up then)."""
    cfg = dict(model="tiny", cuts=(2,), tokens=(TOKEN,), checkpoint_dir=str(tmp_path))
    before = create_app(ServerConfig(**cfg)).test_client()
    tensors_of(post_tensors(before, P.TRAIN_STEP, *step_body(1)))
    first = apply_step(before, "c1", 1)
    assert first.status_code == 200
    assert before.post(P.CHECKPOINT, json={}, headers=auth()).status_code == 200

    app = create_app(ServerConfig(**cfg))  # the restarted server, from the checkpoint
    after = app.test_client()
    w1 = snapshot(segment_of(app))
    assert _client_step(after) == 1
    again = apply_step(after, "c1", 1)
    assert again.get_json() == first.get_json()
    assert_error(post_tensors(after, P.TRAIN_STEP, *step_body(1)), 409, "was applied")  # a piece: its digest
    assert same_weights(w1, snapshot(segment_of(app)))
    tensors_of(post_tensors(after, P.TRAIN_STEP, *step_body(2)))  # and training goes on


@pytest.mark.parametrize("body", [b"\x00\xffgarbage", b'{"rows": 2', b'[1, 2]', b'{"rows": 2, "x": 1}',
                                  b'{"rows": "2"}', b'{"rows": 0}', encode({"rows": torch.ones(1)})])
def test_opening_a_session_with_a_bad_body_is_400_and_opens_nothing(u_app, u, body):
    rt = u_app.extensions["splitlearn"]
    r = u.post(P.SESSIONS, data=body, headers={**auth(), "Content-Type": "application/json"})
    assert_error(r, 400)
    assert rt.sessions.count() == 0


def test_opening_a_session_with_an_empty_body_means_one_row(u):
    r = u.post(P.SESSIONS, headers=auth())
    assert r.status_code == 201 and r.get_json()["rows"] == 1


def test_echo_returns_the_body_untouched(u):
    body = bytes(range(256)) * 64
    r = u.post(P.ECHO, data=body, headers={**auth(), "Content-Type": P.CONTENT_TYPE})
    assert r.status_code == 200 and r.get_data() == body
    assert_error(u.post(P.ECHO, data=body), 401)


# -- degenerate shapes: every one a 400, never a 500 (issue 40, item 6) ----------------------

def _body_of_shape(shape, dtype="F32", extra=None, meta=None) -> bytes:
    """A safetensors body whose ``hidden`` says ``shape`` (anything JSON), its data as long as
    that shape's bytes where they are few, else empty; ``extra`` tensors after it."""
    import json
    import struct
    n = 0
    if isinstance(shape, list) and all(type(x) is int and 0 <= x for x in shape) and len(shape) <= 64:
        n = 4 * int(torch.tensor(shape, dtype=torch.float64).prod()) if shape else 4
        n = n if n <= 1 << 20 else 0
    header, data = {"hidden": {"dtype": dtype, "shape": shape, "data_offsets": [0, n]}}, b"\0" * n
    for name, t in (extra or {}).items():
        raw = t.numpy().tobytes()
        header[name] = {"dtype": {torch.int64: "I64", torch.float32: "F32"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if meta:
        header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


DEGENERATE = [[0, 2 ** 70], [2 ** 70, 0], [0, 2 ** 62, 2 ** 62], [0, 6, D], [2, 0, D], [2, 6, 0], [0, 0, 0],
              [], [2 ** 31, 0, D], [-1, 6, D], [2, 6.0, D], ["2", 6, D], [True, 6, D], [[2], 6, D], None,
              [1] * 65, [0] * 65, [2 ** 64, 1, 1], [2, 6, D, 1]]


@pytest.fixture(scope="module")
def apps():
    return {"2way": create_app(ServerConfig(model="tiny", cuts=(2,), tokens=TENANTS)),
            "u": create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS))}


@pytest.mark.parametrize("shape", DEGENERATE, ids=str)
def test_a_degenerate_shape_is_a_400_on_every_tensor_route(apps, shape):
    labels = torch.zeros(2, 6, dtype=torch.int64)
    posts = [("2way", P.TRAIN_STEP, {P.LABELS: labels}, P.StepMeta("c1", 1).to_meta()),
             ("2way", P.FORWARD, {}, {}), ("u", P.FORWARD, {}, {}),
             ("u", P.TRAIN_FORWARD, {}, P.StepMeta("c1", 1).to_meta())]
    for name, path, extra, meta in posts:
        app = apps[name]
        client, before = app.test_client(), snapshot(segment_of(app))
        r = post_tensors(client, path, {}, data=_body_of_shape(shape, extra=extra, meta=meta))
        assert_error(r, 400)
        assert same_weights(before, snapshot(segment_of(app)))
    client = apps["u"].test_client()  # a generation session's step
    r = client.post(P.SESSIONS, json={"rows": 2}, headers=auth())
    url = P.SESSION_STEP.format(session_id=r.get_json()["session_id"])
    assert_error(post_tensors(client, url, {}, data=_body_of_shape(shape, meta=P.SessionStepMeta(0).to_meta())), 400)
    assert client.delete(P.SESSION.format(session_id=url.split("/")[-2]), headers=auth()).status_code in (200, 204)


class _CountingStream(io.BytesIO):
    reads = 0

    def read(self, n=-1):
        type(self).reads += 1
        return super().read(n)


def test_a_tensor_body_is_read_in_one_read_not_in_chunks():
    """werkzeug's get_data reads 64 KiB at a time and joins them (28 ms for 12.6 MB on the CPU
    host: a third of a crossing over TCP); routing.request_body takes a Content-Length body whole."""
    app = create_app(ServerConfig(model="tiny", cuts=(2,), tokens=(TOKEN,)))
    client = app.test_client()
    tensors, meta = step_body(B=32, T=64)  # 32 x 64 x 32 float32 = 262 KB: five werkzeug reads
    body = encode(tensors, meta)
    _CountingStream.reads = 0
    r = client.post(P.TRAIN_STEP, input_stream=_CountingStream(body), content_length=len(body),
                    headers={**auth(), "Content-Type": P.CONTENT_TYPE})
    assert P.GRAD in tensors_of(r) and _CountingStream.reads == 1
