"""The splitlearn client: ``SplitClient`` for training and generation over HTTP."""
from .core import SplitClient
from .transport import TransportConfig, WireStats

__all__ = ["SplitClient", "TransportConfig", "WireStats"]
