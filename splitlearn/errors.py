"""Every error splitlearn raises, in one place.

The root is :class:`SplitLearnError`; each subclass carries the HTTP status the server
answers with, as ``{"error": CODE, "message": TEXT}``, which the client turns back into the
same class (:func:`from_payload`). ``retryable``: whether repeating the same request can succeed."""
from __future__ import annotations

from typing import Optional


class SplitLearnError(Exception):
    """Root of every splitlearn error."""

    status: int = 500
    code: str = "internal"
    retryable: bool = False

    def __init__(self, message: str, *, retry_after: Optional[float] = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after  # seconds, for 429/503 answers

    def to_payload(self) -> dict:
        return {"error": self.code, "message": self.message}


class ConfigError(SplitLearnError, ValueError):
    """A model, cut or option that cannot work (bad cuts, not a GPT-2, unknown dtype)."""

    status, code = 400, "config"


class SegmentFileError(SplitLearnError, ValueError):
    """An exported segment whose files do not match their spec (hash, shapes, keys)."""

    status, code = 400, "segment_file"


class BadRequest(SplitLearnError, ValueError):
    """A request the server refuses before it touches the model."""

    status, code = 400, "bad_request"


class Unauthorized(SplitLearnError):
    status, code = 401, "unauthorized"


class Forbidden(SplitLearnError):
    """A valid token that may not do this (an operator action without the operator's token)."""

    status, code = 403, "forbidden"


class NotFound(SplitLearnError):
    """Unknown route, or a generation session that does not exist (for this token)."""

    status, code = 404, "not_found"


class Conflict(SplitLearnError):
    """A step number or position that does not follow the state the server holds."""

    status, code = 409, "conflict"


class NotYourTurn(Conflict):
    """Sequential federation: the client does not hold the turn (take it, then retry)."""

    code = "not_your_turn"


class StaleWeights(Conflict):
    """Federation: the client's client-side weights are behind the shared ones (download them)."""

    code = "stale_weights"


class ForwardLost(Conflict):
    """Client side: the server has no forward for a backward (it lost or dropped it): the step
    must run again from its first forward (``SplitClient`` does; the model classes raise it)."""


class RequestTimeout(SplitLearnError):
    """A request that did not arrive within its deadline (the server's front door cut it off)."""

    status, code, retryable = 408, "request_timeout", True


class PayloadTooLarge(SplitLearnError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(SplitLearnError):
    status, code = 415, "unsupported_media_type"


class TooManyRequests(SplitLearnError):
    status, code, retryable = 429, "too_many_requests", True


class ServiceUnavailable(SplitLearnError):
    status, code, retryable = 503, "unavailable", True


class TransportError(SplitLearnError):
    """The server could not be reached, or answered something that is not splitlearn's."""

    status, code, retryable = 502, "transport", True


class IntegrityError(SplitLearnError):
    """A server's answer failed verification (masked offload: Freivalds' check of a product,
    splitlearn/offload/verify.py): the server computed something else; nothing is returned."""

    status, code = 502, "integrity"


_BY_CODE = {
    cls.code: cls
    for cls in (
        SplitLearnError, ConfigError, SegmentFileError, BadRequest, Unauthorized, Forbidden, NotFound,
        Conflict, NotYourTurn, StaleWeights, RequestTimeout, PayloadTooLarge, UnsupportedMediaType, TooManyRequests, ServiceUnavailable,
        TransportError, IntegrityError,
    )
}


def from_status(status: int, message: str) -> SplitLearnError:
    """The error class that answers with HTTP ``status`` (server side: other servers' errors)."""
    by_status: dict[int, type] = {}
    for c in (BadRequest, *_BY_CODE.values()):  # 400 is a BadRequest, not a ConfigError
        by_status.setdefault(c.status, c)
    cls = by_status.get(status, BadRequest if status < 500 else SplitLearnError)
    err = cls(message)
    err.status = status
    return err


def from_payload(status: int, payload: dict, retry_after: Optional[float] = None) -> SplitLearnError:
    """Rebuild the error a server sent as JSON (client side)."""
    cls = _BY_CODE.get(str(payload.get("error")), SplitLearnError)
    err = cls(str(payload.get("message", f"HTTP {status}")), retry_after=retry_after)
    err.status = status
    return err
