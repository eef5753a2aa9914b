"""The splitlearn client: ``SplitClient`` for training and generation over HTTP."""
from .config import ClientConfig
from .core import SplitClient
from ..transport import TransportConfig, WireStats

__all__ = ["ClientConfig", "SplitClient", "TransportConfig", "WireStats"]
