"""What a client accepts from a server: the split it pins, and every answer's tensors.

- :class:`Pins` (``min_client_blocks``, ``expected_cuts``, ``shape``), checked against the
  server's ``/v1/info`` by :func:`check_info` before anything private is sent: a server
  outside them is a :class:`~splitlearn.errors.ConfigError`.
- :func:`answer`, :func:`loss`, :func:`grad_norm`: the tensor asked for, of the expected
  shape, a floating dtype, every value finite; a gradient norm finite and >= 0. Anything else
  is an :class:`~splitlearn.errors.IntegrityError`, raised before it touches the client.

Why: docs/SECURITY.md, 'The client trusts the server no further than it pins'."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import protocol as P
from ..errors import BadRequest, ConfigError, IntegrityError
from .wire import unpack

SHAPES = ("u", "2way")  # Pins.shape: U-shape (the server holds a trunk) or 2-way (it holds the top and the loss)


@dataclass(frozen=True)
class Pins:
    """The splits a client accepts (see the module docstring)."""

    min_client_blocks: int = 1  # blocks the client keeps below the first cut (0: the server sees raw embeddings)
    expected_cuts: Optional[tuple[int, ...]] = None  # the server's cuts must be exactly these (None: any)
    shape: Optional[str] = None  # "u": U-shape only (the labels stay local); "2way": 2-way only; None: either

    def __post_init__(self):
        if not isinstance(self.min_client_blocks, int) or self.min_client_blocks < 0:
            raise ConfigError(f"min_client_blocks must be an integer >= 0, got {self.min_client_blocks!r}")
        if self.shape is not None and self.shape not in SHAPES:
            raise ConfigError(f"shape must be 'u' (labels stay on the client), '2way' or None, got {self.shape!r}")
        if self.expected_cuts is not None:
            cuts = self.expected_cuts
            if isinstance(cuts, int) or not all(isinstance(c, int) for c in cuts) or len(cuts) not in (1, 2):
                raise ConfigError(f"expected_cuts must be one or two block indices, e.g. (2, 10), got {cuts!r}")
            object.__setattr__(self, "expected_cuts", tuple(cuts))
            if cuts[0] < self.min_client_blocks:
                raise ConfigError(f"expected_cuts {list(cuts)} keep {cuts[0]} blocks on the client, fewer than "
                                  f"min_client_blocks={self.min_client_blocks}")
            if self.shape is not None and (len(cuts) == 2) != (self.shape == "u"):
                raise ConfigError(f"expected_cuts {list(cuts)} is not a {self.shape!r} split")


def check_info(info: dict, pins: Pins, server: str = "the server") -> tuple[int, ...]:
    """The server's cuts from its ``/v1/info`` answer ``info``, if this client speaks its protocol
    and the split is within ``pins``; ConfigError (nothing has been sent but the GET) otherwise."""
    if not isinstance(info, dict) or info.get("protocol_version") != P.PROTOCOL_VERSION:
        got = info.get("protocol_version") if isinstance(info, dict) else None
        raise ConfigError(f"{server} speaks protocol {got}, this client {P.PROTOCOL_VERSION}")
    if info.get("mode") == "offload":
        raise ConfigError("this is a masked-offload server: use splitlearn.OffloadGPT2LMHeadModel")
    cuts, n = info.get("cuts"), config_value(info.get("model_config"), "num_hidden_layers")  # any family
    if not (isinstance(cuts, list) and len(cuts) in (1, 2) and isinstance(n, int)
            and all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
            and 0 <= cuts[0] and cuts[-1] <= n and (len(cuts) == 1 or cuts[0] < cuts[1])):
        raise ConfigError(f"{server} announces cuts {cuts!r} for a model of {n!r} blocks: not a split")
    cuts = tuple(cuts)
    shape = "u" if len(cuts) == 2 else "2way"
    if cuts[0] < pins.min_client_blocks:
        raise ConfigError(f"{server} is cut at {cuts[0]}: the client would keep {cuts[0]} block(s) and send "
                          + ("the raw token embeddings (trivially inverted to the text)" if cuts[0] == 0 else
                             "the activations of fewer blocks")
                          + f"; this client requires min_client_blocks={pins.min_client_blocks} (lower it "
                            f"knowingly, or use a server with a later first cut)")
    if pins.expected_cuts is not None and cuts != pins.expected_cuts:
        raise ConfigError(f"{server} has cuts {list(cuts)}; this client expects {list(pins.expected_cuts)}")
    if pins.shape is not None and shape != pins.shape:
        raise ConfigError(f"{server} is a 2-way server (cut {cuts[0]}: it holds the LM head and would receive "
                          f"this client's labels); this client requires shape='u'" if pins.shape == "u" else
                          f"{server} is a U-shape server (cuts {list(cuts)}); this client requires shape='2way'")
    return cuts


def config_value(model_config, name: str):
    """``name`` (transformers' generic config name: ``num_hidden_layers``, ``hidden_size``,
    ``max_position_embeddings``, ...) of a config as ``/v1/info``'s ``model_config`` sends it
    (``config.to_dict()``), None if absent: a family whose config stores it under its own name
    (transformers' ``attribute_map`` of its ``model_type``) is read there. It reads the dict only:
    nothing is built from a server's answer (docs/MODELS.md)."""
    if not isinstance(model_config, dict):
        return None
    if name in model_config:
        return model_config[name]
    kind = model_config.get("model_type")
    if not isinstance(kind, str):
        return None
    from transformers import CONFIG_MAPPING  # the families' config classes, imported when asked
    if kind not in CONFIG_MAPPING:
        return None
    own = (getattr(CONFIG_MAPPING[kind], "attribute_map", None) or {}).get(name)
    return model_config.get(own) if isinstance(own, str) else None


def answer(tensors: dict, name: str, shape: Sequence[int], what: str) -> torch.Tensor:
    """Tensor ``name`` of a server's answer (dequantised as :func:`splitlearn.api.wire.unpack` does),
    if it has ``shape`` and every value is finite; IntegrityError otherwise."""
    try:
        x = unpack(tensors, name)
    except BadRequest as e:
        raise IntegrityError(f"the server's {what} is not usable: {e.message}") from None
    if tuple(x.shape) != tuple(shape):
        raise IntegrityError(f"the server answered {what} of shape {list(x.shape)}; this client sent for "
                             f"{list(shape)}: refused")
    if not _finite(x):
        raise IntegrityError(f"the server's {what} holds NaN or infinite values: refused")
    return x


def _finite(x: torch.Tensor) -> bool:
    """Every value finite: one sum settles it (a non-finite value makes it non-finite); a sum that
    overflowed is checked value by value."""
    total = x.sum(dtype=torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x.sum()
    return bool(torch.isfinite(total)) or bool(torch.isfinite(x).all())


def loss(tensors: dict, what: str = "loss") -> torch.Tensor:
    """The 2-way server's loss: one finite floating-point value; IntegrityError otherwise."""
    x = tensors.get(P.LOSS)
    if not isinstance(x, torch.Tensor) or x.numel() != 1 or not x.is_floating_point():
        raise IntegrityError(f"the server's {what} is not one floating-point value "
                             f"({None if x is None else (x.dtype, list(x.shape))}): refused")
    if not bool(torch.isfinite(x).all()):
        raise IntegrityError(f"the server's {what} is {float(x)}: refused")
    return x


def grad_norm(value) -> float:
    """The server's gradient norm (answer metadata): a finite float >= 0; IntegrityError otherwise."""
    try:
        norm = float(value)
    except (TypeError, ValueError):
        raise IntegrityError(f"the server's grad_norm {str(value)[:40]!r} is not a number: refused") from None
    if not (math.isfinite(norm) and norm >= 0.0):
        raise IntegrityError(f"the server's grad_norm is {norm}: refused (it would poison clip_grad_norm_)")
    return norm
