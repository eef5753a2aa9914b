"""Masked offload (``--offload``): ``POST /v1/offload/linear``, products of the model's linear
layers on one-time-padded inputs (:mod:`splitlearn.server.engine.offload`)."""
from __future__ import annotations

from flask import Blueprint

from ...api import protocol as P
from ..engine.ledger import Answer
from .routing import Served, tensor_route

bp = Blueprint("offload", __name__)


@tensor_route(bp, P.OFFLOAD_LINEAR)
def offload_linear(s: Served, t: dict, meta: dict) -> Answer:
    scheme, items = s.rt.validate(t, meta)
    return s.rt.products(scheme, items)
