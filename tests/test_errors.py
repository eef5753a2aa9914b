"""One error hierarchy: statuses, JSON payloads, and their round trip through the client."""
import pytest

from splitlearn import errors as E

ALL = [E.SplitLearnError, E.ConfigError, E.SegmentFileError, E.BadRequest, E.Unauthorized,
       E.NotFound, E.Conflict, E.NotYourTurn, E.StaleWeights, E.PayloadTooLarge, E.UnsupportedMediaType, E.TooManyRequests,
       E.ServiceUnavailable, E.TransportError]


@pytest.mark.parametrize("cls", ALL)
def test_payload_round_trip_gives_the_same_class(cls):
    err = cls("what went wrong", retry_after=3.0)
    back = E.from_payload(err.status, err.to_payload(), 3.0)
    assert type(back) is cls and back.message == "what went wrong" and back.retry_after == 3.0
    assert back.status == err.status and set(err.to_payload()) == {"error", "message"}


def test_codes_are_unique_and_statuses_sane():
    assert len({c.code for c in ALL}) == len(ALL)
    assert all(400 <= c.status < 600 for c in ALL)
    assert [c for c in ALL if c.retryable] == [E.TooManyRequests, E.ServiceUnavailable, E.TransportError]


def test_unknown_code_becomes_the_root_and_status_maps_back():
    err = E.from_payload(418, {"error": "teapot", "message": "short and stout"})
    assert type(err) is E.SplitLearnError and err.status == 418
    assert type(E.from_status(413, "too big")) is E.PayloadTooLarge
    assert type(E.from_status(400, "bad")) is E.BadRequest
    assert E.from_status(400, "bad").status == 400
    assert type(E.from_status(599, "odd")) is E.SplitLearnError


def test_config_errors_are_value_errors():
    assert issubclass(E.ConfigError, ValueError) and issubclass(E.BadRequest, ValueError)
