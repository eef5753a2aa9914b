"""splitlearn.api.protocol: message fields survive the trip through string metadata; bad ones are refused."""
import pytest

from splitlearn.api import protocol as P
from splitlearn.errors import BadRequest
from splitlearn.api.wire import decode, encode
import torch


def _through_the_wire(meta: dict) -> dict:
    return decode(encode({"t": torch.zeros(1)}, meta))[1]


def test_step_meta_round_trip():
    m = P.StepMeta("client_A.1-x", 42, "int8")
    meta = _through_the_wire(m.to_meta())
    assert meta == {"client_id": "client_A.1-x", "step": "42", "wire_dtype": "int8", "micro": "0", "micros": "0",
                    "loss_scale": "1.0"}
    assert P.StepMeta.from_meta(meta) == m


def test_step_meta_defaults_to_float32():
    assert P.StepMeta.from_meta({"client_id": "c", "step": "1", "micros": "0"}) == P.StepMeta("c", 1, "float32")


@pytest.mark.parametrize("micros", ["1", "2", "64", None])
def test_a_closed_step_is_refused(micros):
    """Closed steps (micros >= 1; absent meant 1) are gone: one protocol, micros=0 and an apply."""
    meta = {"client_id": "c", "step": "1"} if micros is None else {"client_id": "c", "step": "1", "micros": micros}
    with pytest.raises(BadRequest, match=r"closed training steps \(micros >= 1\) are gone: send micros=0"):
        P.StepMeta.from_meta(meta)


@pytest.mark.parametrize("meta, words", [
    ({"step": "1"}, "client_id"),
    ({"client_id": "", "step": "1"}, "client_id"),
    ({"client_id": "a/b", "step": "1"}, "client_id"),
    ({"client_id": "a b", "step": "1"}, "client_id"),
    ({"client_id": "x" * 65, "step": "1"}, "client_id"),
    ({"client_id": "abc\n", "step": "1"}, "client_id"),  # `$` alone would let a newline through
    ({"client_id": "c", "micros": "0"}, "'step' is missing"),
    ({"client_id": "c", "micros": "0", "step": "two"}, "integer"),
    ({"client_id": "c", "micros": "0", "step": "1.0"}, "integer"),
    ({"client_id": "c", "micros": "0", "step": "0"}, ">= 1"),
    ({"client_id": "c", "micros": "0", "step": "-3"}, ">= 1"),
    ({"client_id": "c", "micros": "0", "step": "1", "wire_dtype": "float64"}, "wire dtype"),
])
def test_step_meta_refuses_bad_fields(meta, words):
    with pytest.raises(BadRequest) as e:
        P.StepMeta.from_meta(meta)
    assert words in str(e.value)


def test_session_step_meta_round_trip():
    m = P.SessionStepMeta(17, "bfloat16")
    meta = _through_the_wire(m.to_meta())
    assert meta == {"position": "17", "wire_dtype": "bfloat16"}
    assert P.SessionStepMeta.from_meta(meta) == m
    assert P.SessionStepMeta.from_meta({"position": "0"}) == P.SessionStepMeta(0, "float32")


@pytest.mark.parametrize("meta, words", [
    ({}, "'position' is missing"),
    ({"position": "x"}, "integer"),
    ({"position": "-1"}, ">= 0"),
    ({"position": "0", "wire_dtype": "int4"}, "wire dtype"),
])
def test_session_step_meta_refuses_bad_fields(meta, words):
    with pytest.raises(BadRequest, match=words):
        P.SessionStepMeta.from_meta(meta)


def test_valid_client_id():
    assert P.valid_client_id("a" * 64)
    assert not P.valid_client_id("a" * 65)
    assert not P.valid_client_id("ok\n")
    assert not P.valid_client_id("..\\x")


def test_routes_fill_in():
    assert P.SESSION_STEP.format(session_id="s1") == "/v1/sessions/s1/step"
    assert P.CLIENT_STATE.format(client_id="c") == "/v1/clients/c"
