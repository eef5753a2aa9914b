"""``AutoOffloadModelForCausalLM``: a causal LM of any family the adapter knows (docs/MODELS.md)
whose every linear layer (``nn.Linear``, GPT-2's ``Conv1D``; ``Arch.linear_paths``) and LM head is
a :class:`~.remote.RemoteLinear`, computed by an untrusted server on one-time-padded inputs;
everything else (embeddings, norms, rotary, attention scores, softmax, the KV cache, softcaps) runs
here, in the family's own forward. Inference only. ``OffloadGPT2LMHeadModel`` is GPT-2's class of
it. Usage, memory and costs: docs/OFFLOAD.md."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field as dc_field
from typing import Optional

from transformers import GPT2LMHeadModel

from ..api import protocol as P
from ..api.fingerprint import config_differences
from ..transport import Transport, TransportConfig
from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.loading import ModelSource, load_model
from ..offloadmath.layers import SCHEMES, QuantisedLayers, linear_weights
from .pads import ON_EMPTY, PadPool, Refiller
from .remote import OffloadChannel, RemoteLinear, _Layer
from .verify import Freivalds

log = logging.getLogger(__name__)


@dataclass
class OffloadConfig:
    server: str  # URL of a `python -m splitlearn.server --model M --offload` server
    token: Optional[str] = None  # its bearer token
    scheme: str = "masked"  # masked | plain (unmasked float32 products: a measurement baseline)
    verify: bool = True  # Freivalds' check of every product (masked); False only to measure its cost
    pad_rows: int = 256  # pad rows precomputed per block linear layer (one row = one token of one sequence)
    head_pad_rows: int = 32  # pad rows of the LM head (generate needs one per sequence per step)
    refill: str = "background"  # background: a thread tops pools up below half | none
    on_empty: str = "compute"  # a pool that runs out: compute | wait | raise (never reuse)
    lanes: int = 2  # row groups in flight at once for products of >= overlap_rows rows
    overlap_rows: int = 16  # rows from which a product is split across lanes
    siblings: bool = True  # products of one input (a Llama's q, k, v; gate, up) in one request, learned on the first forward
    transport: dict = dc_field(default_factory=dict)  # extra TransportConfig fields (timeouts, retries)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ConfigError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.refill not in ("background", "none"):
            raise ConfigError(f"refill must be background or none, got {self.refill!r}")
        if self.on_empty not in ON_EMPTY:
            raise ConfigError(f"on_empty must be one of {ON_EMPTY}, got {self.on_empty!r}")
        if self.pad_rows < 1 or self.head_pad_rows < 1 or self.lanes < 1 or self.overlap_rows < 1:
            raise ConfigError("pad_rows, head_pad_rows, lanes and overlap_rows must be >= 1")


def linear_modules(model) -> dict:
    """``{name on the wire: module}`` of every layer ``model`` offloads (``Arch.linear_paths``)."""
    return {name: model.get_submodule(path) for name, path in arch_of(model.config).linear_paths(model).items()}


class OffloadMixin:
    """The offload side of a ``*ForCausalLM``: its linear layers replaced by remote ones
    (:meth:`_attach`), its statistics, :meth:`close`. Mixed into the family's own class."""

    @classmethod
    def from_pretrained(cls, source: ModelSource, *, server: str, token: Optional[str] = None,
                        seed: int = 0, **options):
        """``source``: what :func:`splitlearn.load_model` takes (``seed`` for random inits: the
        server's ``--seed``); ``options``: :class:`OffloadConfig` fields. Fills the pad pools."""
        cfg = OffloadConfig(server=server, token=token, **options)
        model = load_model(source, seed=seed)
        want = offload_class(type(model))
        if not issubclass(want, cls):
            raise ConfigError(f"{source!r} is a {type(model).__name__}, not what {cls.__name__} offloads: "
                              f"use splitlearn.AutoOffloadModelForCausalLM")
        model.__class__ = want  # the same module tree; only the linear layers change below
        model._attach(cfg)
        return model

    def _attach(self, cfg: OffloadConfig) -> None:
        self.offload_config = cfg
        self.offload_transport = Transport(TransportConfig(cfg.server, cfg.token, **cfg.transport))
        info = self.offload_transport.get_json(P.INFO)
        if info.get("mode") != "offload":
            raise ConfigError(f"{cfg.server} is not an offload server (start it with --offload)")
        differ = config_differences(self.config.to_dict(), info["model_config"])
        if differ:
            raise ConfigError("the server's model is another model than this one: " + "; ".join(differ[:8]))
        if cfg.scheme not in info["offload"]["schemes"]:
            raise ConfigError(f"the server does not answer scheme {cfg.scheme!r} (it offers {info['offload']['schemes']})")
        arch = arch_of(self.config)
        paths = arch.linear_paths(self)  # name on the wire -> module path here
        modules = linear_modules(self)
        weights = linear_weights(modules)
        layers: dict[str, _Layer] = {}
        t0 = time.perf_counter()
        if cfg.scheme == "masked":
            quantised = QuantisedLayers(modules)
            if quantised.digest() != info["offload"]["weights_digest"]:
                raise ConfigError("the server holds other weights than this model (weights digest differs): "
                                  "load the same checkpoint, or the same spec and --seed, on both sides")
            for name, q in quantised.items():
                pool = PadPool(q, cfg.head_pad_rows if name == arch.head_name else cfg.pad_rows, cfg.on_empty)
                layers[name] = _Layer(q, pool, Freivalds(q) if cfg.verify else None)
        else:
            layers = {name: _Layer(None, None, None) for name in weights}
        self.offload_setup_s = time.perf_counter() - t0
        self.offload_channel = OffloadChannel(self.offload_transport, layers, cfg.scheme, cfg.lanes, cfg.overlap_rows,
                                             cfg.siblings)
        self.offload_pools = [layer.pool for layer in layers.values() if layer.pool is not None]
        t0 = time.perf_counter()
        for pool in self.offload_pools:  # "offline": before the first request
            pool.refill()
        self.offload_precompute_s = time.perf_counter() - t0
        for name, path in paths.items():  # the module keeps its parameters (state dict, tying unchanged)
            m = modules[name]
            w, bias = weights[name]
            self.set_submodule(path, RemoteLinear(name, self.offload_channel, m.weight, bias, w.shape[1]))
        self.offload_refiller = Refiller(self.offload_pools) if cfg.refill == "background" and self.offload_pools else None
        log.info("offload to %s: %d layers, scheme %s, setup %.2fs, pads precomputed in %.2fs",
                 cfg.server, len(layers), cfg.scheme, self.offload_setup_s, self.offload_precompute_s)

    @property
    def offload_stats(self) -> dict:
        """Counts and seconds: products, requests, masking, checking, waiting, bytes, pads."""
        t = self.offload_transport.stats
        pools = self.offload_pools
        return {**self.offload_channel.stats.as_dict(), "bytes_sent": t.bytes_sent,
                "bytes_received": t.bytes_received, "server_s": t.server_compute_s,
                "round_trip_s": t.round_trip_s, "pads_issued": sum(p.issued for p in pools),
                "pads_late": sum(p.late for p in pools), "pads_make_s": sum(p.make_s for p in pools),
                "pads_ready": sum(p.level for p in pools)}

    def close(self) -> None:
        """Stop the refill thread and close the server connections."""
        if getattr(self, "offload_refiller", None) is not None:
            self.offload_refiller.close()
        self.offload_transport.close()


class OffloadGPT2LMHeadModel(OffloadMixin, GPT2LMHeadModel):
    """A ``GPT2LMHeadModel`` whose linear layers run remotely on masked inputs."""


_CLASSES: dict[type, type] = {GPT2LMHeadModel: OffloadGPT2LMHeadModel}


def offload_class(cls: type) -> type:
    """The offload class of a family's ``*ForCausalLM`` (``OffloadLlamaForCausalLM``), made once."""
    if issubclass(cls, OffloadMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Offload{cls.__name__}", (OffloadMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


class AutoOffloadModelForCausalLM:
    """Masked offload of any family: ``AutoOffloadModelForCausalLM.from_pretrained(source,
    server=URL, token=...)`` -> the family's ``*ForCausalLM`` (its class mixed with
    :class:`OffloadMixin`) whose linear layers run on the server (docs/OFFLOAD.md)."""

    def __init__(self):
        raise TypeError("use AutoOffloadModelForCausalLM.from_pretrained(source, server=..., token=...)")

    @staticmethod
    def from_pretrained(source: ModelSource, *, server: str, token: Optional[str] = None, seed: int = 0,
                        **options):
        return OffloadMixin.from_pretrained(source, server=server, token=token, seed=seed, **options)
