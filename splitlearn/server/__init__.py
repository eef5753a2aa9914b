"""The splitlearn server: one segment of a GPT-2 behind a Flask app (``create_app``)."""
from .app import create_app
from .config import ServerConfig
from .runtime import SegmentRuntime

__all__ = ["ServerConfig", "SegmentRuntime", "create_app"]
