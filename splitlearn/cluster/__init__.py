"""Replicas of a splitlearn server behind HAProxy: ``python -m splitlearn.cluster`` (docs/CLUSTER.md).

:mod:`.config` (what the cluster is started with), :mod:`.haproxy` (the router's
configuration: consistent hashing on the client's route header, health checks, failover),
:mod:`.supervisor` (the processes), :mod:`.store` (the TCPStore where SplitFed replicas meet;
their rounds: :mod:`splitlearn.server.collective`). Per-client state shared by the replicas lives in
:mod:`splitlearn.server.clientstate`; the client's route header in :mod:`splitlearn.transport`.
"""
from .config import ClusterConfig

__all__ = ["ClusterConfig"]
