"""Replicas of a splitlearn server behind HAProxy: ``python -m splitlearn.cluster`` (docs/CLUSTER.md).

:mod:`.config` (the validated options), :mod:`.haproxy` (the router's configuration),
:mod:`.supervisor` (the processes), :mod:`.store` (the TCPStore where SplitFed replicas meet)."""
from .config import ClusterConfig

__all__ = ["ClusterConfig"]
