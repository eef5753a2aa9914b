"""The splitlearn server: one segment of a GPT-2 behind a Flask app (``create_app``)."""
from .._extras import require

require("server", "flask", "waitress", what="the splitlearn server")

from .http.app import create_app  # noqa: E402
from .config import ServerConfig
from .engine.runtime import SegmentRuntime

__all__ = ["ServerConfig", "SegmentRuntime", "create_app"]
