"""Attacks that read the input tokens back from the activations the server receives.

The attacker sees ``y = defense.apply(bottom(x))`` (B, T, d) and wants the ids ``x``:
learned inverters ``linear``, ``mlp``, ``gru`` trained on public text through the same
bottom and defense (:func:`train_inverter`), and white-box inversion knowing the bottom's
weights (:func:`invert_whitebox`: greedy, position by position) and the optimisation attack
(:func:`invert_optimize`: all positions at once, maximum a posteriori under the defense's noise
with the best inverter's guess as the prior, a la BiSR). Every attack returns predicted ids
(B, T); :func:`recovery` is the top-1 fraction correct. See docs/PRIVACY.md, 'Attacks'.

The learned inverters read activations only: they run on every family the adapter cuts
(:mod:`splitlearn.model.arch`). The white-box and optimisation attacks run the bottom's layers
on a hand-built 4-D mask (each candidate sees the prefix and itself) with absolute learned
position embeddings added to the token embeddings: the families in :data:`WHITEBOX_FAMILIES`
(GPT-2); :func:`attacks_for` names what a model's family supports (docs/MODELS.md)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..model.segments import Segment
from ..defense.defenses import Defense, GaussianNoise

log = logging.getLogger(__name__)

LEARNED = ("linear", "mlp", "gru")
ATTACKS = LEARNED + ("whitebox", "optimize")
KNOWING = ("whitebox", "optimize")  # the attacks that run the bottom's weights
#: the families whose layers the white-box and optimisation attacks can run on a hand-built 4-D
#: candidate mask: a layer called ``layer(x, None, mask)`` with one additive/boolean mask for every
#: layer and learned absolute positions (no rotary, no per-layer-type masks, no softcaps)
WHITEBOX_FAMILIES = ("gpt2",)


@dataclass
class AttackConfig:
    """How hard the attacker trains; the defaults fit a CPU and the shipped corpus."""

    epochs: int = 30            # passes over the public activations (fresh noise each)
    batch_tokens: int = 2048    # tokens per optimiser step (whole sequences for the GRU)
    lr: float = 3e-3            # Adam learning rate
    hidden: int = 256           # MLP hidden width
    gru_hidden: int = 64        # GRU hidden size per direction
    weight_decay: float = 0.0   # Adam weight decay
    whitebox_candidates: int = 512  # white-box tries every candidate token up to this many;
                                    # above it, the top ones of the best learned inverter
    seed: int = 0               # inverter initialisation, batching and noise
    opt_steps: int = 150        # optimisation attack: Adam steps on the relaxed tokens
    opt_lr: float = 0.1         # ... and their learning rate

    def __post_init__(self):
        if not self.opt_lr > 0:
            raise ConfigError("AttackConfig.opt_lr must be > 0")
        for f in ("epochs", "batch_tokens", "hidden", "gru_hidden", "whitebox_candidates", "opt_steps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"AttackConfig.{f} must be a positive integer, got {v!r}")
        if not self.lr > 0 or not self.weight_decay >= 0:
            raise ConfigError("AttackConfig.lr must be > 0 and weight_decay >= 0")


def check_attacks(attacks) -> tuple[str, ...]:
    """The attack names as a tuple; :class:`ConfigError` for an unknown one or none."""
    attacks = (attacks,) if isinstance(attacks, str) else tuple(attacks)
    if not attacks:
        raise ConfigError("give at least one attack")
    for a in attacks:
        if a not in ATTACKS:
            raise ConfigError(f"unknown attack {a!r}; known attacks: {', '.join(ATTACKS)}")
    return attacks


def attacks_for(config) -> tuple[str, ...]:
    """The attacks that run on ``config``'s family: every one for :data:`WHITEBOX_FAMILIES`, the
    learned inverters for the others."""
    return ATTACKS if config.model_type in WHITEBOX_FAMILIES else LEARNED


def check_family(attacks: Sequence[str], config) -> None:
    """ConfigError when ``attacks`` ask for a white-box or optimisation attack on a family that
    does not have it (docs/MODELS.md, 'Not yet')."""
    bad = [a for a in attacks if a in KNOWING and a not in attacks_for(config)]
    if bad:
        raise ConfigError(f"the {' and '.join(bad)} attack{'s' if len(bad) > 1 else ''} run on "
                          f"{', '.join(WHITEBOX_FAMILIES)} only (a hand-built candidate mask through the "
                          f"layers, learned positions); {config.model_type!r} gets the learned inverters "
                          f"({', '.join(LEARNED)}): docs/MODELS.md")


def _token_embedding(bottom: Segment) -> nn.Module:
    return getattr(bottom, bottom.arch.embed_names[0])


def _embed(bottom: Segment, position_ids: torch.Tensor, input_ids=None, inputs_embeds=None) -> torch.Tensor:
    """The bottom's embeddings through the adapter (token + learned positions, then dropout)."""
    names = bottom.arch.embed_names
    return bottom.arch.embed({n: getattr(bottom, n, None) for n in names}, position_ids,
                             input_ids=input_ids, inputs_embeds=inputs_embeds)


def recovery(pred: torch.Tensor, ids: torch.Tensor) -> float:
    """Top-1 fraction of tokens recovered: ``pred`` and ``ids`` are (B, T) ids."""
    return (pred.to(ids.device) == ids).float().mean().item()


@torch.no_grad()
def bottom_activations(bottom: Segment, ids: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """The bottom's clean output for ``ids`` (N, T), in chunks: (N, T, d) float32."""
    dev = next(bottom.parameters()).device
    out = [bottom(ids[i:i + batch].to(dev)).float() for i in range(0, len(ids), batch)]
    return torch.cat(out)  # (N, T, d)


class Inverter(nn.Module):
    """Activations (B, T, d) -> logits over the attacker's candidate tokens (B, T, K).

    ``hidden`` is the MLP's hidden width or the GRU's hidden size per direction."""

    def __init__(self, kind: str, d: int, n_classes: int, hidden: int):
        super().__init__()
        self.kind = kind
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("std", torch.ones(d))
        if kind == "linear":
            self.net = nn.Linear(d, n_classes)
        elif kind == "mlp":
            self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, n_classes))
        elif kind == "gru":
            self.inp = nn.Linear(d, hidden)
            self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
            self.net = nn.Linear(2 * hidden, n_classes)
        else:
            raise ConfigError(f"unknown inverter {kind!r}; known: {', '.join(LEARNED)}")

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        z = (y - self.mean) / self.std  # (B, T, d), standardised with public statistics
        if self.kind == "gru":
            z, _ = self.gru(torch.nn.functional.gelu(self.inp(z)))  # (B, T, 2 * hidden)
        return self.net(z)  # (B, T, K)


def _defended(h: torch.Tensor, defense: Optional[Defense], gen: torch.Generator) -> torch.Tensor:
    return h if defense is None else defense.apply(h, generator=gen)


def train_inverter(kind: str, h: torch.Tensor, ids: torch.Tensor, defense: Optional[Defense],
                   classes: torch.Tensor, config: AttackConfig = AttackConfig()) -> Inverter:
    """Fit a learned inverter on public activations ``h`` (N, T, d) of the public ``ids`` (N, T),
    the defense applied anew every epoch; ``classes``: the candidate ids (K,) it predicts among.
    Returns the inverter in eval mode."""
    g = torch.Generator(device="cpu").manual_seed(config.seed)
    gen = torch.Generator(device=h.device).manual_seed(config.seed + 1)
    torch.manual_seed(config.seed)  # nn.Module init
    d = h.shape[-1]
    hidden = config.gru_hidden if kind == "gru" else config.hidden
    inv = Inverter(kind, d, len(classes), hidden).to(h.device)
    lookup = torch.full((int(classes.max()) + 1,), -100, dtype=torch.long, device=h.device)
    lookup[classes.to(h.device)] = torch.arange(len(classes), device=h.device)
    target = lookup[ids.to(h.device)]  # (N, T) class index of each token
    with torch.no_grad():
        y0 = _defended(h, defense, gen).reshape(-1, d)  # (N*T, d)
        inv.mean.copy_(y0.mean(0))
        inv.std.copy_(y0.std(0).clamp_min(1e-6))
    opt = torch.optim.Adam(inv.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    N, T = ids.shape
    per_step = max(1, config.batch_tokens // T)  # sequences per step
    steps_per_epoch = max(1, N // per_step)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, config.epochs * steps_per_epoch)
    inv.train()
    for epoch in range(config.epochs):
        with torch.no_grad():
            y = _defended(h, defense, gen)  # (N, T, d): fresh noise each epoch
        order = torch.randperm(N, generator=g).to(h.device)
        for s in range(steps_per_epoch):
            idx = order[s * per_step:(s + 1) * per_step]
            logits = inv(y[idx])  # (b, T, K)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               target[idx].reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        log.debug("%s inverter epoch %d loss %.3f", kind, epoch, loss.item())
    return inv.eval()


@torch.no_grad()
def invert_learned(inv: Inverter, y: torch.Tensor, classes: torch.Tensor, topk: int = 1,
                   batch: int = 64) -> torch.Tensor:
    """Predicted ids (B, T) for observed activations ``y`` (B, T, d); with ``topk`` > 1 the
    ``topk`` best ids (B, T, topk), best first."""
    out = []
    for i in range(0, len(y), batch):
        logits = inv(y[i:i + batch])  # (b, T, K)
        out.append(classes.to(y.device)[logits.topk(min(topk, len(classes)), -1).indices])
    pred = torch.cat(out)  # (B, T, topk)
    return pred[..., 0] if topk == 1 else pred


@torch.no_grad()
def invert_whitebox(bottom: Segment, y: torch.Tensor, candidates: torch.Tensor,
                    defense: Optional[Defense] = None, batch: int = 16) -> torch.Tensor:
    """Recover ids (B, T) from observed activations ``y`` (B, T, d), knowing the bottom.

    candidates: (K,) ids tried at every position, or (B, T, K) per position. Greedy, position by
    position; with :class:`GaussianNoise` the candidates are clipped the same way."""
    out = [_whitebox_batch(bottom, y[i:i + batch], candidates if candidates.dim() == 1
                           else candidates[i:i + batch], defense)
           for i in range(0, len(y), batch)]
    return torch.cat(out)  # (B, T)


def _whitebox_batch(bottom: Segment, y: torch.Tensor, candidates: torch.Tensor,
                    defense: Optional[Defense]) -> torch.Tensor:
    check_family(("whitebox",), bottom.config)
    dev = next(bottom.parameters()).device
    y = y.to(dev).float()
    B, T, _ = y.shape
    clip = defense.clip_tokens if isinstance(defense, GaussianNoise) else (lambda v: v)
    rec = torch.zeros(B, T, dtype=torch.long, device=dev)
    for t in range(T):
        cand = (candidates.to(dev)[None].expand(B, -1) if candidates.dim() == 1
                else candidates[:, t].to(dev))  # (B, K)
        K = cand.shape[1]
        ids = torch.cat([rec[:, :t], cand], 1)  # (B, t + K)
        pos = torch.cat([torch.arange(t, device=dev), torch.full((K,), t, device=dev)])
        L = t + K
        allow = torch.zeros(L, L, dtype=torch.bool, device=dev)
        allow[:t, :t] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        allow[t:, :t] = True  # every candidate sees the prefix ...
        allow[t:, t:] = torch.eye(K, dtype=torch.bool, device=dev)  # ... and itself only
        x = _embed(bottom, pos, input_ids=ids)  # (B, L, d): token + position embeddings
        mask = allow[None, None].expand(B, 1, L, L)
        for block in bottom.layers_list:
            x = block(x, None, mask)  # (B, L, d)
            x = x[0] if isinstance(x, tuple) else x
        hc = clip(x[:, t:].float())  # (B, K, d): each candidate's vector at position t
        dist = (hc - y[:, t:t + 1]).pow(2).sum(-1)  # (B, K)
        rec[:, t] = cand.gather(1, dist.argmin(1, keepdim=True))[:, 0]
    return rec


@torch.no_grad()
def inverter_log_probs(inv: Inverter, y: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """The inverter's log-probabilities (B, T, K) over its classes for activations ``y`` (B, T, d)."""
    return torch.cat([inv(y[i:i + batch]).log_softmax(-1) for i in range(0, len(y), batch)])


def invert_optimize(bottom: Segment, y: torch.Tensor, classes: torch.Tensor, defense: Optional[Defense] = None,
                    prior: Optional[torch.Tensor] = None, config: AttackConfig = AttackConfig(),
                    batch: int = 16) -> torch.Tensor:
    """Recover ids (B, T) from observed activations ``y`` (B, T, d), knowing the bottom, by
    optimisation (BiSR's, arXiv 2409.00960, on the forward activations): every position is a
    softmax over the candidate ids ``classes`` (K,), embedded as the softmax-weighted token
    embeddings, run through the bottom (causal, all positions at once) and clipped as the defense
    clips; Adam maximises the Gaussian log-likelihood of ``y`` under the defense's noise plus the
    log-prior ``prior`` (B, T, K), e.g. the best learned inverter's log-probabilities, which also
    starts the search. The argmax of each position is the guess."""
    out = [_optimize_batch(bottom, y[i:i + batch], classes, defense,
                           None if prior is None else prior[i:i + batch], config)
           for i in range(0, len(y), batch)]
    return torch.cat(out)  # (B, T)


def _optimize_batch(bottom, y, classes, defense, prior, config):
    check_family(("optimize",), bottom.config)
    dev = next(bottom.parameters()).device
    y = y.to(dev).float()
    B, T, _ = y.shape
    classes = classes.to(dev)
    K = len(classes)
    clip = defense.clip_tokens if isinstance(defense, GaussianNoise) else (lambda v: v)
    noise = defense.sigma * defense.clip if isinstance(defense, GaussianNoise) else 0.0
    # the likelihood's scale: the noise, or (none) a small fraction of the activations' size
    var = noise ** 2 + (0.05 * y.norm(dim=-1).mean().item()) ** 2 / y.shape[-1]
    logp = prior.to(dev).float() if prior is not None else torch.zeros(B, T, K, device=dev)
    z = logp.clone().requires_grad_()  # (B, T, K) relaxed tokens, started at the prior
    emb = _token_embedding(bottom).weight[classes].detach()  # (K, d)
    pos = torch.arange(T, device=dev)  # (T,)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None].expand(B, 1, T, T)
    params = [p for p in bottom.parameters()]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        opt = torch.optim.Adam([z], lr=config.opt_lr)
        for _ in range(config.opt_steps):
            w = z.softmax(-1)  # (B, T, K)
            x = _embed(bottom, pos, inputs_embeds=w @ emb)  # (B, T, d): + position embeddings
            for block in bottom.layers_list:
                x = block(x, None, mask)
                x = x[0] if isinstance(x, tuple) else x
            nll = (clip(x) - y).pow(2).sum(-1) / (2 * var)  # (B, T)
            loss = (nll - (w * logp).sum(-1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return classes[z.detach().argmax(-1)]  # (B, T)
