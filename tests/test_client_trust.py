"""The client trusts the server no further than it pins (splitlearn/api/trust.py; docs/SECURITY.md).

A lying server: a real server process (U-shape (1, 3) and 2-way (2,)) behind an in-process
proxy that records every request and rewrites the answers it is told to. The attacks:

- ``/v1/info`` announcing cut 0 (the client would send the raw token embeddings) or a 2-way
  split to a client that asked for ``shape="u"`` (it would send its labels): refused with a
  ConfigError on the info, and the proxy saw nothing but that GET;
- answers of the wrong shape, NaN values, a NaN ``grad_norm`` (which, taken, turns every
  gradient of the client's into NaN through ``clip_grad_norm_``): refused with an
  IntegrityError, the client's weights bit-identical and no gradient non-finite.
"""
from __future__ import annotations

import json
import threading

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.errors import ConfigError, IntegrityError
from splitlearn.hf import SplitGPT2LMHeadModel
from splitlearn.api.trust import Pins, answer, check_info, grad_norm
from splitlearn.api.wire import decode, encode

from serverproc import TOKEN, InprocServerProcess, web

pytestmark = pytest.mark.slow


class LyingProxy:
    """Forwards every request to ``upstream`` and records ``(method, path)``; ``lies`` maps a
    path to a function rewriting its (200) answer's bytes."""

    def __init__(self, upstream: str):
        from flask import Flask, Response, request
        from werkzeug.serving import make_server

        self.upstream, self.seen, self.lies = upstream, [], {}
        app = Flask(__name__)

        @app.route("/<path:path>", methods=["GET", "POST", "DELETE"])
        def relay(path):
            path = "/" + path
            self.seen.append((request.method, path))
            headers = {k: v for k, v in request.headers.items()
                       if k in ("Authorization", "Content-Type", P.ROUTE_HEADER)}
            r = web.request(request.method, self.upstream + path, data=request.get_data(),
                            headers=headers, timeout=60)
            body = r.content
            lie = next((f for p, f in self.lies.items() if path.startswith(p)), None)
            if lie is not None and r.status_code == 200:
                body = lie(body)
            return Response(body, status=r.status_code, content_type=r.headers.get("Content-Type"))

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self) -> list:
        return [s for s in self.seen if s[0] == "POST"]


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def lying(request):
    with InprocServerProcess(request.param) as srv:
        proxy = LyingProxy(srv.url)
        proxy.u_shape = len(request.param) == 2
        yield proxy
        proxy.server.shutdown()


def info_saying(**change):
    def lie(body: bytes) -> bytes:
        return json.dumps({**json.loads(body), **change}).encode()
    return lie


def tensors_changed(fn, meta_change=None):
    """A lie on a safetensors answer: ``fn`` rewrites its tensors (in place), ``meta_change`` its metadata."""
    def lie(body: bytes) -> bytes:
        tensors, meta = decode(body)
        fn(tensors)
        return encode(tensors, {**meta, **(meta_change or {})})
    return lie


def batch(seed=0, rows=2, T=8):
    ids = torch.randint(0, 256, (rows, T), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the split: refused before anything is sent -------------------------------------------

def test_the_pins_are_checked_on_their_own():
    info = {"protocol_version": P.PROTOCOL_VERSION, "cuts": [1, 3], "model_config": {"model_type": "llama",
                                                                                   "num_hidden_layers": 4}}
    assert check_info(info, Pins()) == (1, 3)
    # a family that names the layers its own way (transformers' attribute_map): read there
    assert check_info({**info, "model_config": {"model_type": "gpt2", "n_layer": 4}}, Pins()) == (1, 3)
    for lying in ({"model_type": "gpt2", "num_layers": 4}, {"model_type": ["gpt2"], "n_layer": 4},
                  {"model_type": "no-such-family", "n_layer": 4}, None):
        with pytest.raises(ConfigError, match="for a model of None blocks"):
            check_info({**info, "model_config": lying}, Pins())
    for change, pins, words in [({"cuts": [0, 3]}, Pins(), "raw token embeddings"),
                                ({"cuts": [2]}, Pins(shape="u"), "labels"),
                                ({"cuts": [1, 2]}, Pins(expected_cuts=(1, 3)), r"expects \[1, 3\]"),
                                ({"cuts": [3, 1]}, Pins(), "not a split"), ({"cuts": [1, 9]}, Pins(), "not a split"),
                                ({"cuts": "1"}, Pins(), "not a split"), ({"protocol_version": 0}, Pins(), "protocol")]:
        with pytest.raises(ConfigError, match=words):
            check_info({**info, **change}, pins)
    assert check_info({**info, "cuts": [0, 3]}, Pins(min_client_blocks=0)) == (0, 3)  # knowingly
    for bad in (dict(min_client_blocks=-1), dict(shape="v"), dict(expected_cuts=(0, 3)),
                dict(expected_cuts=(2,), shape="u"), dict(expected_cuts=3)):
        with pytest.raises(ConfigError):
            Pins(**bad)
    for g in ("nan", "inf", "-1", "x"):
        with pytest.raises(IntegrityError):
            grad_norm(g)
    assert answer({P.HIDDEN: torch.full((2, 3, 4), 3e38)}, P.HIDDEN, (2, 3, 4), "h") is not None  # its sum overflows
    for bad, dtype in [(float("nan"), torch.float32), (float("inf"), torch.float32), (-float("inf"), torch.bfloat16),
                       (float("nan"), torch.float16)]:
        x = torch.randn(2, 3, 4).to(dtype)
        x[1, 2, 3] = bad
        with pytest.raises(IntegrityError, match="NaN or infinite"):
            answer({P.HIDDEN: x}, P.HIDDEN, (2, 3, 4), "h")
    with pytest.raises(IntegrityError, match="shape"):
        answer({P.HIDDEN: torch.zeros(2, 3, 4)}, P.HIDDEN, (2, 4, 4), "h")
    with pytest.raises(IntegrityError, match="not usable"):
        answer({P.HIDDEN: torch.zeros(2, 3, 4, dtype=torch.long)}, P.HIDDEN, (2, 3, 4), "h")


@pytest.mark.parametrize("lie, pins, words", [
    (dict(cuts=[0, 3]), {}, "raw token embeddings"),  # a server started with --cut 0
    (dict(cuts=[2]), dict(shape="u"), "labels"),  # a 2-way server: the labels would travel
    (dict(cuts=[1, 2]), dict(expected_cuts=(1, 3)), "expects"),
], ids=["cut0", "2way-when-u", "unexpected-cuts"])
def test_a_split_outside_the_pins_is_refused_before_anything_is_sent(lying, lie, pins, words):
    lying.lies = {P.INFO: info_saying(**lie)}
    lying.seen.clear()
    try:
        with pytest.raises(ConfigError, match=words):
            SplitGPT2LMHeadModel.from_pretrained("tiny", server=lying.url, token=TOKEN, **pins)
        with pytest.raises(ConfigError, match=words):
            SplitClient(lying.url, "tiny", token=TOKEN, device="cpu", **pins)
        assert lying.seen == [("GET", P.INFO)] * 2  # nothing but the question: no activation, no label
    finally:
        lying.lies = {}
    if lie["cuts"] == [0, 3]:  # accepted only when the client lowers its pin knowingly
        lying.lies = {P.INFO: info_saying(**lie)}
        try:
            model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=lying.url, token=TOKEN, min_client_blocks=0)
            assert model.transformer.cuts == (0, 3)
            model.remote.close()
        finally:
            lying.lies = {}


# -- every answer: refused unless it is what was asked for ----------------------------------

def _nan(name):
    def fn(t):
        t[name] = t[name].clone()
        t[name].view(-1)[0] = float("nan")
    return fn


def _short(name):
    def fn(t):
        t[name] = t[name][:, :-1].contiguous()
    return fn


def _attacks(u_shape: bool):
    out = [("nan grad_norm", P.TRAIN_BACKWARD, tensors_changed(lambda t: None, {"grad_norm": "nan"}), "grad_norm"),
           ("nan gradient", P.TRAIN_BACKWARD, tensors_changed(_nan(P.GRAD)), "NaN"),
           ("short gradient", P.TRAIN_BACKWARD, tensors_changed(_short(P.GRAD)), "shape")]
    if u_shape:
        out += [("nan trunk output", P.TRAIN_FORWARD, tensors_changed(_nan(P.HIDDEN)), "NaN"),
                ("short trunk output", P.TRAIN_FORWARD, tensors_changed(_short(P.HIDDEN)), "shape")]
    else:
        out += [("nan loss", P.TRAIN_FORWARD, tensors_changed(_nan(P.LOSS)), "loss")]
    return out


def test_a_lying_answer_in_training_is_refused_and_the_client_is_unchanged(lying):
    """The plain loop (forward, backward, clip_grad_norm_, step) against each lie. Unchecked, a
    NaN grad_norm made clip_grad_norm_ turn every client gradient into NaN, and the step every
    client weight."""
    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=lying.url, token=TOKEN)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask = batch()
    try:
        for name, path, lie, words in _attacks(lying.u_shape):
            before, step = weights(model), model.remote.step
            lying.lies = {path: lie}
            try:
                with pytest.raises(IntegrityError, match=words):
                    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
            finally:
                lying.lies = {}
            after = weights(model)
            assert all(torch.equal(before[k], after[k]) for k in before), name  # nothing moved
            assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()), name
            assert model.remote.steps.server_norm is None and model.remote.step == step, name
            opt.zero_grad()  # (also drops the refused step's pieces on the server)
        # an honest answer again: the loop goes on
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert all(bool(torch.isfinite(v).all()) for v in weights(model).values())
    finally:
        model.remote.close()


def test_a_lying_answer_to_splitclient_and_to_generation_is_refused(lying):
    client = SplitClient(lying.url, "tiny", token=TOKEN, device="cpu", optimizer="sgd", lr=0.1)
    ids, mask = batch(1)
    try:
        before = {i: weights(s) for i, s in enumerate(client.segments)}
        path = P.TRAIN_FORWARD if lying.u_shape else P.TRAIN_STEP
        name = P.HIDDEN if lying.u_shape else P.GRAD
        lying.lies = {path: tensors_changed(_nan(name))}
        try:
            with pytest.raises(IntegrityError, match="NaN"):
                client.train_step(ids, mask)
        finally:
            lying.lies = {}
        for i, s in enumerate(client.segments):
            now = weights(s)
            assert all(torch.equal(before[i][k], now[k]) for k in now)
        assert client.step == 0
        model = client.model
        model.eval()
        lying.lies = {"/v1/sessions/": tensors_changed(_nan(P.HIDDEN if lying.u_shape else P.LOGITS))}
        try:
            with pytest.raises(IntegrityError, match="NaN"):
                model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
            with pytest.raises(IntegrityError, match="NaN"):
                client.generate(ids[:, :4], max_new_tokens=3)
        finally:
            lying.lies = {}
        if not lying.u_shape:  # an evaluation's logits of another vocabulary
            lying.lies = {P.FORWARD: tensors_changed(lambda t: t.update({P.LOGITS: t[P.LOGITS][..., :-1].contiguous()}))}
            try:
                with torch.no_grad(), pytest.raises(IntegrityError, match="shape"):
                    model(input_ids=ids, attention_mask=mask)
            finally:
                lying.lies = {}
    finally:
        client.close()
