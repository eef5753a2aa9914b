"""Client-side defenses: what the client does to the cut-layer activations before they leave::

    sent = defense.apply(h)                # h = bottom(input_ids) (B, T, d); differentiable
    loss = task_loss + (defense.loss(inputs_embeds, h) or 0)

:class:`GaussianNoise` (per-token clip + noise, with an (epsilon, delta) guarantee) and
:class:`NoPeek` (a distance-correlation loss, no guarantee). See docs/PRIVACY.md, 'Defenses'."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from ..errors import ConfigError
from .accounting import composed_gaussian_epsilon, gaussian_epsilon

log = logging.getLogger(__name__)


@dataclass
class Defense:
    """Base class: a defense that sends ``h`` unchanged and adds no loss."""

    name = "none"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (subclasses extend)."""

    def apply(self, h: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """What is sent for the bottom's output ``h`` (B, T, d); differentiable in ``h``."""
        return h

    def loss(self, inputs: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
        """The extra training loss (a scalar) given the token embeddings ``inputs`` (B, T, d)
        and the bottom's output ``h`` (B, T, d); None when the defense adds none."""
        return None

    def epsilon(self, delta: float, steps: int = 1, tokens: int = 1,
                accountant: str = "rdp") -> Optional[float]:
        """epsilon at ``delta``; None for defenses without a formal guarantee."""
        return None

    def describe(self) -> dict:
        """JSON-able ``{"name": ..., <fields>}`` (the generator left out)."""
        d = {k: v for k, v in asdict(self).items() if k != "generator"}
        return {"name": self.name, **d}


@dataclass
class GaussianNoise(Defense):
    """Clip each token's activation to L2 norm ``clip``, add N(0, (sigma * clip)^2) noise.

    ``residual`` (U-shape only): the client keeps the residual stream's identity path. The server
    computes its blocks from the noised activations as always; the client adds the server's
    *update* (its output minus what was sent) to its own clean activations instead of taking the
    output as it is. The server sees exactly the same; the client's last blocks see clean input."""

    sigma: float = 1.0                 # noise multiplier: noise std = sigma * clip
    clip: float = 1.0                  # per-token L2 norm bound C, in activation units
    generator: Optional[torch.Generator] = field(default=None, repr=False, compare=False)
    residual: bool = False             # U-shape: clean + (server output - sent) on the client
    grad_sigma: float = 0.0            # U-shape training: noise multiplier of the gradient sent back
    grad_clip: Optional[float] = None  # ... and its per-token L2 bound (see :meth:`defend_gradient`)

    name = "gaussian"

    def validate(self) -> None:
        for f in ("sigma", "clip"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ConfigError(f"GaussianNoise.{f} must be a number, got {v!r}")
        if self.sigma < 0:
            raise ConfigError(f"GaussianNoise.sigma must be >= 0, got {self.sigma}")
        if self.clip <= 0:
            raise ConfigError(f"GaussianNoise.clip must be > 0, got {self.clip}")
        if self.residual not in (True, False, 0, 1):
            raise ConfigError(f"GaussianNoise.residual must be a bool, got {self.residual!r}")
        self.residual = bool(self.residual)
        g, c = self.grad_sigma, self.grad_clip
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0 or math.isinf(g):
            raise ConfigError(f"GaussianNoise.grad_sigma must be a finite number >= 0, got {g!r}")
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not c > 0 or math.isinf(c)):
            raise ConfigError(f"GaussianNoise.grad_clip must be a finite number > 0, got {c!r}")
        if g > 0 and c is None:
            raise ConfigError("GaussianNoise.grad_sigma needs grad_clip (the per-token L2 bound of the "
                              "gradient sent at the second cut; its noise std is grad_sigma * grad_clip)")

    def describe(self) -> dict:
        d = super().describe()
        if not self.residual:
            d.pop("residual")  # as before the residual design existed
        if not self.defends_gradient:
            d.pop("grad_sigma"), d.pop("grad_clip")  # as before the gradient defense existed
        return d

    # -- the gradient channel (U-shape training) -----------------------------------------------

    @property
    def defends_gradient(self) -> bool:
        """Whether the gradient the client sends back at a U-shape's second cut is clipped (and
        noised): ``grad_clip`` set."""
        return self.grad_clip is not None

    def defend_gradient(self, grad: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """What the client sends the server for the gradient ``grad`` (B, T, d) of its loss with
        respect to the server's output at the second cut: per token clipped to L2 norm
        ``grad_clip`` and noised with N(0, (grad_sigma * grad_clip)^2), in the units of a loss
        *summed* over the B * (T - 1) predicted tokens (the causal LM's loss is their mean: the
        gradient is multiplied by B * (T - 1) first and divided after, so ``grad_clip`` does not
        depend on the batch size). Unchanged without ``grad_clip``. Not differentiable (it is the
        backward message)."""
        if not self.defends_gradient:
            return grad
        gen = generator if generator is not None else self.generator
        scale = float(grad.shape[0] * max(grad.shape[1] - 1, 1)) if grad.ndim == 3 else 1.0
        g = grad.detach().float() * scale  # (B, T, d): per-token gradients of the summed loss
        norms = g.norm(dim=-1, keepdim=True)  # (B, T, 1)
        g = g * (self.grad_clip / norms.clamp_min(1e-12)).clamp(max=1.0)  # (B, T, d)
        if self.grad_sigma > 0:
            noise = torch.randn(g.shape, generator=gen, device=g.device, dtype=g.dtype)  # (B, T, d)
            g = g + (self.grad_sigma * self.grad_clip) * noise
        return (g / scale).to(grad.dtype)  # (B, T, d)

    def gradient_epsilon(self, delta: float, steps: int = 1, tokens: int = 1,
                         accountant: str = "rdp") -> Optional[float]:
        """epsilon at ``delta`` of the gradient channel alone: ``tokens * steps`` released gradient
        vectors, each clipped to ``grad_clip`` (L2 sensitivity 2 * grad_clip) with noise std
        ``grad_sigma * grad_clip`` (noise multiplier grad_sigma / 2); None without the gradient
        defense, ``inf`` when it clips without noise."""
        if not self.defends_gradient:
            return None
        _check_releases(steps, tokens)
        return gaussian_epsilon(self.grad_sigma / 2, steps * tokens, delta, accountant)

    def training_epsilon(self, delta: float, steps: int = 1, tokens: int = 1,
                         accountant: str = "rdp") -> float:
        """epsilon at ``delta`` of U-shape training: per send, ``tokens`` activations and, with the
        gradient defense, ``tokens`` gradients (the two Gaussian mechanisms composed); the
        gradient undefended: ``inf`` (it is released in clear)."""
        if not self.defends_gradient:
            return math.inf
        _check_releases(steps, tokens)
        return composed_gaussian_epsilon([(self.noise_multiplier, steps * tokens),
                                          (self.grad_sigma / 2, steps * tokens)], delta, accountant)

    def clip_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (B, T, d) with each token's vector scaled to L2 norm <= clip."""
        norms = h.norm(dim=-1, keepdim=True)  # (B, T, 1)
        scale = (self.clip / norms.clamp_min(1e-12)).clamp(max=1.0)  # (B, T, 1)
        return h * scale  # (B, T, d)

    def apply(self, h: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        gen = generator if generator is not None else self.generator
        clipped = self.clip_tokens(h)  # (B, T, d)
        if self.sigma == 0:
            return clipped
        noise = torch.randn(h.shape, generator=gen, device=h.device, dtype=h.dtype)  # (B, T, d)
        return clipped + (self.sigma * self.clip) * noise  # (B, T, d)

    @property
    def noise_multiplier(self) -> float:
        """Noise std over L2 sensitivity: ``sigma * clip / (2 * clip)``."""
        return self.sigma / 2

    def epsilon(self, delta: float, steps: int = 1, tokens: int = 1,
                accountant: str = "rdp") -> float:
        """epsilon at ``delta`` for ``tokens * steps`` released vectors (``tokens`` per send, e.g. T;
        ``steps`` sends; generation: ``tokens=prompt_length + new_tokens, steps=1``)."""
        _check_releases(steps, tokens)
        return gaussian_epsilon(self.noise_multiplier, steps * tokens, delta, accountant)


def _check_releases(steps, tokens) -> None:
    for name, v in (("steps", steps), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")


@dataclass
class NoPeek(Defense):
    """Add ``weight * dCor(inputs, h)`` to the client's training loss (NoPeek).

    ``inputs``: the token embeddings of ``input_ids`` (the embedding module's output, B, T, d),
    detached. ``unit``: one dCor sample per ``"sequence"`` (B samples) or per ``"token"`` (B * T,
    O((B T)^2) memory). Tensors only: any family's activations."""

    weight: float = 0.1   # multiplier of the distance correlation in the loss (>= 0)
    unit: str = "sequence"  # sequence | token

    name = "nopeek"

    def validate(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not self.weight >= 0:
            raise ConfigError(f"NoPeek.weight must be a number >= 0, got {self.weight!r}")
        if self.unit not in ("sequence", "token"):
            raise ConfigError(f"NoPeek.unit must be 'sequence' or 'token', got {self.unit!r}")

    def loss(self, inputs: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x, z = inputs.detach(), h
        if self.unit == "sequence":
            x, z = x.reshape(x.shape[0], -1), z.reshape(z.shape[0], -1)  # (B, T*d)
        else:
            x, z = x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])  # (B*T, d)
        return self.weight * distance_correlation(x, z)


def _centered_distances(x: torch.Tensor) -> torch.Tensor:
    """Double-centred Euclidean distance matrix of the rows of ``x`` (n, p) -> (n, n)."""
    sq = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)  # (n, n)
    d = sq.clamp_min(1e-12).sqrt()  # finite gradient on the diagonal
    return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation dCor(x, z) in [0, 1] of paired rows: x (n, p), z (n, q), n >= 2;
    differentiable in both."""
    if x.shape[0] != z.shape[0] or x.shape[0] < 2:
        raise ConfigError(f"distance correlation needs the same number (>= 2) of rows, got "
                          f"{x.shape[0]} and {z.shape[0]}")
    a, b = _centered_distances(x.float()), _centered_distances(z.float())  # (n, n) each
    dcov2 = (a * b).mean()
    denom = ((a * a).mean() * (b * b).mean()).sqrt().clamp_min(1e-12)
    return (dcov2 / denom).clamp_min(1e-12).sqrt()


@dataclass
class GaussianNoPeek(GaussianNoise):
    """Both: :class:`GaussianNoise` on what is sent (with its epsilon) and :class:`NoPeek`'s
    ``weight * dCor(inputs, h)`` in the training loss (computed on ``h`` before the noise)."""

    weight: float = 0.1
    unit: str = "sequence"

    name = "gaussian+nopeek"

    def validate(self) -> None:
        super().validate()
        NoPeek.validate(self)

    def loss(self, inputs: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return NoPeek.loss(self, inputs, h)


DEFENSES = {"none": Defense, "gaussian": GaussianNoise, "nopeek": NoPeek,
            "gaussian+nopeek": GaussianNoPeek}


def make_defense(name: str, **kwargs) -> Defense:
    """A defense by name (``none``, ``gaussian``, ``nopeek``, ``gaussian+nopeek``) and its fields."""
    if name not in DEFENSES:
        raise ConfigError(f"unknown defense {name!r}; known: {', '.join(DEFENSES)}")
    fields = {f.name for f in dataclasses.fields(DEFENSES[name])} - {"generator"}
    bad = sorted(set(kwargs) - fields)
    if bad:
        raise ConfigError(f"defense {name!r} has no field {bad[0]!r}; its fields: "
                          f"{', '.join(sorted(fields)) or 'none'}")
    return DEFENSES[name](**kwargs)


def parse_defense(spec: str, **defaults) -> Defense:
    """A defense from its command-line form ``NAME[:FIELD=VALUE,...]``: ``gaussian:sigma=2``,
    ``nopeek:weight=0.5``, ``gaussian+nopeek:sigma=1,weight=0.3,clip=2.4``, ``none``;
    ``residual=1``: :class:`GaussianNoise`'s U-shape residual design; ``grad_sigma=S,grad_clip=C``:
    its gradient defense (U-shape training: the gradient sent back at the second cut).
    ``defaults`` fill the fields the spec does not give and the defense has (e.g. ``clip``).
    Raises :class:`ConfigError` naming what is wrong."""
    name, _, rest = str(spec).strip().partition(":")
    if name not in DEFENSES:
        raise ConfigError(f"unknown defense {name!r}; known: {', '.join(DEFENSES)} (or recommended)")
    kwargs: dict = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"defense {spec!r}: {item!r} is not FIELD=VALUE")
        key = key.strip()
        try:
            kwargs[key] = (value.strip() if key == "unit" else
                           bool(float(value)) if key == "residual" else float(value))
        except ValueError:
            raise ConfigError(f"defense {spec!r}: {key} must be a number, got {value!r}") from None
    fields = {f.name for f in dataclasses.fields(DEFENSES[name])}
    for k, v in defaults.items():
        if k in fields and k not in kwargs and v is not None:
            kwargs[k] = v
    return make_defense(name, **kwargs)
