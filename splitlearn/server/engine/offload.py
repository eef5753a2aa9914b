"""The server of masked offload (``--offload``): products of a model's linear layers on
one-time-padded inputs, and nothing else.

Where a split server runs blocks on activations it can read, this one only multiplies:
it holds every layer's linear layers (any family: those the architecture adapter names,
``Arch.linear_paths``) and the LM head in fixed point (``Wq``, :mod:`splitlearn.offloadmath.layers`) and answers ``POST /v1/offload/linear`` with
``Zi = Xi~ Wq mod pi`` for inputs the client masked with one-time pads (Slalom, Tramer &
Boneh, ICLR 2019; the arithmetic: :mod:`splitlearn.offloadmath.field`). It never sees an
activation, a bias, an attention score or a layer norm. The route goes through the app's
``tensor_route``, so auth, tenants, body limits and JSON errors are those of every route::

    WSGI thread:     body (415 unless octet-stream; 413 over --max-body-mb; 401 without a token)
    compute thread:  decode -> validate(): scheme, layer names, tensor names, dtypes, shapes,
                     rows, every value in [0, pi), memory -> field_matmul per product -> answer

A request carries up to ``MAX_PRODUCTS`` products (``x.0``, ``x.1``..., layers named in the
``layers`` metadata; byte layout in :mod:`splitlearn.offloadmath.layers`). ``scheme=plain``
(float32, unmasked) is answered only by a server started with ``--offload-plain`` (the
benchmark's baseline). The routes are :mod:`splitlearn.server.http.api_offload`'s.
"""
from __future__ import annotations

import logging
import threading

import torch

from ...api import protocol as P
from ...errors import BadRequest, PayloadTooLarge
from ...model.arch import arch_of
from ...model.loading import load_model
from ...offloadmath.field import PRIMES, field_matmul
from ...offloadmath.layers import MAX_PRODUCTS, SCHEMES, QuantisedLayers, linear_weights
from .budget import body_account
from .compute import ComputeThread
from ..config import ServerConfig
from .ledger import Answer
from .memory import charge
from .priority import QueueWaits

log = logging.getLogger(__name__)

DEFAULT_MEMORY = 1 << 30  # bytes one request may use when --max-request-memory-gb is not given


class OffloadRuntime:
    """The quantised linear layers of one model; :meth:`products` runs on the compute thread."""

    adapters = None  # the app's LoRA routes answer 404

    def __init__(self, cfg: ServerConfig, compute: ComputeThread | None = None):
        self.cfg = cfg
        self.compute = compute or ComputeThread(cfg.torch_threads)
        self.compute.run(self._load)
        self.lock = threading.Lock()
        self.served = 0  # products computed
        self.waits = QueueWaits()  # waits for the compute thread (the app's tensor_route records them)

    def _load(self) -> None:
        cfg = self.cfg
        model = load_model(cfg.model, seed=cfg.seed)  # float32, cpu
        self.config = model.config
        arch = arch_of(model.config)
        modules = {name: model.get_submodule(path) for name, path in arch.linear_paths(model).items()}
        self.layers = QuantisedLayers(modules)
        self.digest = self.layers.digest()
        self.names = list(self.layers)
        # what a 400 for an unknown layer lists: one layer's names, and the head
        self.name_help = (", ".join(n.replace(f"{arch.layers_name}.0.", f"{arch.layers_name}.<i>.", 1)
                                    for n in self.names if n.startswith(f"{arch.layers_name}.0."))
                          + f" (i < {arch.n_layers}) and {arch.head_name}")
        # the plain baseline multiplies the float32 weights; kept only when it is enabled
        self.plain = ({k: w.detach().contiguous() for k, (w, _) in linear_weights(modules).items()}
                      if cfg.offload_plain else None)
        positions = getattr(self.config, "max_position_embeddings", None) or 2048  # rows a request may hold
        self.max_rows = cfg.max_batch * positions
        self.memory = cfg.max_request_memory_bytes or DEFAULT_MEMORY
        # tenants' bodies (reserved by the door as they are announced) and each request's products,
        # per tenant and in total, as on a segment server (--max-memory-gb, --max-tenant-memory-gb)
        self.account = body_account(len(cfg.tenants), cfg.max_memory_bytes, cfg.max_tenant_memory_bytes)
        log.info("offload: %d linear layers of %s in fixed point (digest %s)", len(self.layers),
                 cfg.model, self.digest[:16])

    def info(self) -> dict:
        c = self.cfg
        return {
            "protocol_version": P.PROTOCOL_VERSION, "mode": "offload",
            "model_config": self.config.to_dict(), "device": "cpu",
            "offload": {"route": P.OFFLOAD_LINEAR, "schemes": ["masked"] + (["plain"] if self.plain else []),
                        "primes": list(PRIMES), "layers": len(self.layers), "weights_digest": self.digest,
                        "max_products": MAX_PRODUCTS, "max_rows": self.max_rows, "served": self.served},
            "waits": self.waits.summary(),
            "limits": {"max_body_bytes": c.max_body_bytes, "max_request_memory_bytes": self.memory},
        }

    def checkpoint(self) -> None:
        return None  # nothing changes: the weights are fixed

    # -- validation -----------------------------------------------------------------------

    def validate(self, tensors: dict, meta: dict) -> tuple[str, list[tuple[str, torch.Tensor]]]:
        """``(scheme, [(layer, input)])``, or BadRequest / PayloadTooLarge before any compute."""
        scheme = meta.get("scheme", "masked")
        if scheme not in SCHEMES:
            raise BadRequest(f"metadata 'scheme' must be one of {SCHEMES}, got {scheme!r}")
        if scheme == "plain" and self.plain is None:
            raise BadRequest("this server computes masked products only (start it with --offload-plain "
                             "for the unmasked baseline)")
        names = meta.get("layers", "").split(",")
        if not 1 <= len(names) <= MAX_PRODUCTS:
            raise BadRequest(f"metadata 'layers' names 1..{MAX_PRODUCTS} layers, comma-separated")
        expected = {f"x.{k}" for k in range(len(names))}
        if set(tensors) != expected:
            raise BadRequest(f"the body must hold exactly the tensors {sorted(expected)}, got {sorted(tensors)[:10]}")
        items, cost = [], 0
        for k, name in enumerate(names):
            layer = self.layers.get(name)
            if layer is None:
                raise BadRequest(f"unknown layer {name[:80]!r}: layers are {self.name_help}")
            n_in, out = layer.shape
            x = tensors[f"x.{k}"]
            if scheme == "masked":
                if x.dtype != torch.int32 or x.ndim != 3 or x.shape[0] != 2 or x.shape[2] != n_in:
                    raise BadRequest(f"x.{k} must be int32 [2, rows, {n_in}] for {name}, got {x.dtype} {list(x.shape)}")
                for i, p in enumerate(PRIMES):
                    if bool((x[i] < 0).any()) or bool((x[i] >= p).any()):
                        raise BadRequest(f"x.{k}[{i}] holds values outside [0, {p})")
            elif x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] != n_in:
                raise BadRequest(f"x.{k} must be float32 [rows, {n_in}] for {name}, got {x.dtype} {list(x.shape)}")
            elif not bool(torch.isfinite(x).all()):
                raise BadRequest(f"x.{k} contains NaN or inf")
            rows = x.shape[-2]
            if not 1 <= rows <= self.max_rows:
                raise BadRequest(f"x.{k} has {rows} rows; this server takes 1..{self.max_rows}")
            cost += rows * (n_in + out) * 2 * 8  # float64 operands and products, both primes
            items.append((name, x))
        if cost > self.memory:
            raise PayloadTooLarge(f"these products need ~{cost >> 20} MiB; this server allows "
                                  f"{self.memory >> 20} MiB per request")
        charge(cost, "these products")  # in the memory account until the answer is built (503 past it)
        return scheme, items

    # -- compute --------------------------------------------------------------------------

    @torch.no_grad()
    def products(self, scheme: str, items: list[tuple[str, torch.Tensor]]) -> Answer:
        out = {}
        for k, (name, x) in enumerate(items):
            if scheme == "plain":
                out[f"y.{k}"] = x @ self.plain[name]  # (n, out) float32, unmasked baseline
                continue
            out[f"y.{k}"] = self.product(name, x)
        return Answer(out)

    def product(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x Wq mod p`` for both primes of one masked input: ``(2, n, out)`` int32."""
        z = field_matmul(x, self.layers[name].wq)
        with self.lock:
            self.served += 1
        return z
