"""The server's segment as an ``nn.Module`` whose forward and backward cross the wire.

:class:`RemoteSegment` stands in for the blocks a splitlearn server holds: the trunk
``blocks[c1:c2]`` of a U-shape server, or the top ``blocks[c:n] + ln_f + lm_head`` (with the
loss) of a 2-way server. With gradients enabled its forward is a ``torch.autograd.Function``
(:class:`_TrunkFunction`, :class:`_LossFunction`) so ``loss.backward()`` sends the gradient,
exactly as if the blocks were local; without gradients (``torch.no_grad()``, evaluation,
``generate``) it is one ``POST /v1/forward``.

Training is numbered as everywhere in splitlearn (docs/PROTOCOL.md): every request carries
``client_id``, ``step`` (the optimizer step it belongs to, 1, 2, 3...) and ``micro`` (the
piece of that step, 0, 1, 2...), with ``micros = 0``: an **open-ended** step, whose pieces the
server accumulates until the client's optimizer steps::

    forward (grad on)   POST /v1/train/forward   hidden [+ attention_mask] (+ labels, 2-way)
                                                 -> hidden (U) | loss F32 [1] (2-way)
    loss.backward()     POST /v1/train/backward  grad (B, T, d) (U) | grad F32 [1] (2-way)
                                                 -> grad (B, T, d); metadata grad_norm
    optimizer.step()    POST /v1/train/apply     JSON {client_id, step, pieces, lr, clip}
                                                 -> {applied, step, pieces, lr, grad_norm, durable}

Tensor bodies are safetensors (``wire_dtype`` as chosen; the 2-way scalar gradient is always
F32), never pickle. A retry (a dropped connection) repeats the same numbers and gets the
stored answer. ``optimizer.step()`` of any ``torch.optim`` optimizer over the model's
parameters triggers the apply (a global step post-hook, or :meth:`RemoteSegment.attach_optimizer`
for one optimizer), with that optimizer's *current* learning rate, so LR schedules drive both
sides; ``zero_grad`` with gradients pending on the server discards them there
(``{"discard": true}``).

**Gradient clipping across both sides.** The server's gradient is represented on the client
by one parameter, :attr:`RemoteSegment.grad_proxy` (shape ``[1]``), whose ``.grad`` each
backward sets to the L2 norm of the server's accumulated parameter gradients. So
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (what ``Trainer`` and
accelerate call) computes the *global* norm over both sides and scales the proxy like every
other gradient; the apply then sends the factor the proxy was scaled by (``clip``) and the
server multiplies its gradients by it before stepping: the same clip as the unsplit model.
Any other uniform scaling of gradients (``loss * k`` before backward is already exact)
reaches the server the same way. The proxy's value is never used (the optimizer moves it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import protocol as P
from ..errors import ConfigError, Conflict, ServiceUnavailable, TransportError
from ..wire import check_wire_dtype, pack, unpack
from .journal import RequestLog, Sent, digest

log = logging.getLogger(__name__)


@dataclass
class RemoteConfig:
    """Where the server is and how to talk to it."""

    server: str  # base URL, e.g. http://127.0.0.1:8000
    token: Optional[str] = None  # bearer token (default $SPLITLEARN_TOKEN)
    client_id: Optional[str] = None  # this data owner's name on the server (default: random)
    wire_dtype: str = "float32"  # float32, bfloat16, float16 or int8 for activations and gradients
    timeout_s: float = 300.0  # seconds to wait for one answer
    retries: int = 6  # reconnects after a dropped connection (numbered requests: exactly once)
    wait_timeout_s: float = 600.0  # the longest wait for a segment busy with another client's step
    reconnect_timeout_s: float = 120.0  # the longest wait for a crashed server to come back (then replay)

    def __post_init__(self):
        self.wire_dtype = check_wire_dtype(self.wire_dtype)
        if self.client_id is not None and not P.valid_client_id(self.client_id):
            raise ConfigError(f"client_id must be 1-64 characters of [A-Za-z0-9_.-], got {self.client_id!r}")


# -- the optimizer hook --------------------------------------------------------------------

_LIVE: "weakref.WeakSet[RemoteSegment]" = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_HOOK = None


def _ensure_hook() -> None:
    """One global ``torch.optim`` step post-hook for the process: after any optimizer's step,
    every live :class:`RemoteSegment` whose model that optimizer trains applies its step; and
    ``torch.optim.Optimizer.zero_grad`` wrapped once, so that a ``zero_grad`` between a
    backward and a step discards the server's pending gradients too (torch has no zero_grad hook)."""
    global _HOOK
    with _HOOK_LOCK:
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_after_step)
            inner = torch.optim.Optimizer.zero_grad

            def zero_grad(self, *args, **kwargs):
                out = inner(self, *args, **kwargs)
                for remote in list(_LIVE):
                    if remote.answered and remote._covers(self):
                        remote.discard_pending()
                return out

            zero_grad.__wrapped__ = inner
            zero_grad.__doc__ = inner.__doc__
            torch.optim.Optimizer.zero_grad = zero_grad


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for remote in list(_LIVE):
        remote.after_optimizer_step(optimizer)


# -- autograd over the wire ------------------------------------------------------------------

class _TrunkFunction(torch.autograd.Function):
    """U-shape: hidden (B, T, d) -> the trunk's output (B, T, d) computed by the server."""

    @staticmethod
    def forward(ctx, hidden, proxy, remote: "RemoteSegment", mask):
        out, ctx.piece = remote.send_forward(hidden, mask, None)
        ctx.remote, ctx.like = remote, (hidden.dtype, hidden.device)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.remote.send_backward(ctx.piece, grad, *ctx.like), None, None, None


class _LossFunction(torch.autograd.Function):
    """2-way: hidden (B, T, d) + labels -> the server's causal-LM loss (mean over targets), ()."""

    @staticmethod
    def forward(ctx, hidden, proxy, remote: "RemoteSegment", labels, mask):
        loss, ctx.piece = remote.send_forward(hidden, mask, labels)
        ctx.remote, ctx.like = remote, (hidden.dtype, hidden.device)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.remote.send_backward(ctx.piece, grad, *ctx.like), None, None, None, None


class RemoteSegment(nn.Module):
    """The server's blocks (and, 2-way, its head and loss) as a module of the client's model.

    Holds no weight of the server's: one connection, the step and piece counters, and
    :attr:`grad_proxy` (see the module docstring).
    """

    def __init__(self, cfg: RemoteConfig, transport=None, info: Optional[dict] = None):
        super().__init__()
        from ..client.transport import Transport, TransportConfig  # requests: only when connecting

        self.cfg = cfg
        token = cfg.token or os.environ.get("SPLITLEARN_TOKEN")
        self.transport = transport or Transport(TransportConfig(cfg.server, token, read_timeout_s=cfg.timeout_s,
                                                                retries=cfg.retries))
        self.info = info or self.transport.get_json(P.INFO)
        if self.info.get("protocol_version") != P.PROTOCOL_VERSION:
            raise ConfigError(f"server speaks protocol {self.info.get('protocol_version')}, "
                              f"this client {P.PROTOCOL_VERSION}")
        if self.info.get("mode") == "offload":
            raise ConfigError("this is a masked-offload server: use splitlearn.OffloadGPT2LMHeadModel")
        self.cuts = tuple(int(c) for c in self.info["cuts"])
        self.u_shape = len(self.cuts) == 2
        self.client_id = cfg.client_id or uuid.uuid4().hex[:16]
        self.transport.set_route(P.route_key(self.transport.cfg.token, self.client_id))
        self.grad_proxy = nn.Parameter(torch.zeros(1))  # .grad: the server's gradient norm
        self._proxy_set: Optional[torch.Tensor] = None  # the value the last backward gave it
        state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        self.step = int(state["step"]) + 1  # the optimizer step the next pieces belong to
        self.pieces = 0  # forwards sent in this step
        self.answered = 0  # backwards answered in this step
        self.server_norm: Optional[float] = None  # the server's accumulated gradient norm
        self._norm_pieces = 0  # how many pieces that norm covers
        self.last_apply: Optional[dict] = None  # the server's answer to the last apply
        self.applies = 0
        self._optimizer_ref = None  # attach_optimizer: only this one triggers the apply
        self._owner_ref = None  # the model whose parameters identify its optimizers
        self.defense = None  # a splitlearn.privacy.Defense on what crosses the cut (the model's .defense)
        # the requests since the server's last durable step, replayed if it restarts (.journal)
        self.log = RequestLog(enabled=bool(self.info.get("checkpoint", {}).get("enabled")))
        self.log.durable(int(state.get("durable", 0)))
        _LIVE.add(self)
        _ensure_hook()

    def extra_repr(self) -> str:
        what = f"blocks [{self.cuts[0]}, {self.cuts[1]})" if self.u_shape else \
            f"blocks [{self.cuts[0]}, n) + ln_f + lm_head + loss"
        return f"{what} on {self.cfg.server}, client_id={self.client_id!r}, wire={self.cfg.wire_dtype}"

    @property
    def stats(self):
        """Calls (round trips), bytes, times: :class:`splitlearn.client.transport.WireStats`."""
        return self.transport.stats

    def close(self) -> None:
        """Drop whatever this client has pending on the server (a forward with gradients on that
        was never backpropagated holds a shared segment until the lease timeout), then hang up."""
        try:
            self.discard_pending(force=True)
        finally:
            self.transport.close()

    def bind(self, model: nn.Module) -> None:
        """The model this segment belongs to: an optimizer over any of its parameters applies."""
        self._owner_ref = weakref.ref(model)

    # -- the pieces of a step ------------------------------------------------------------

    def trunk(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """U-shape: the trunk's output (B, T, d) for ``hidden`` (B, T, d); ``attention_mask``
        (B, T) 0/1 or None. Differentiable when gradients are enabled."""
        if torch.is_grad_enabled():
            return _TrunkFunction.apply(hidden, self.grad_proxy, self, attention_mask)
        return self.evaluate(hidden, attention_mask)[0]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor,
             attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """2-way, gradients enabled: the server's causal-LM loss (a 0-dim tensor, differentiable)."""
        return _LossFunction.apply(hidden, self.grad_proxy, self, labels, attention_mask)

    def _meta(self, step: int, micro: int) -> dict:
        return P.StepMeta(self.client_id, step, self.cfg.wire_dtype, micro=micro, micros=0).to_meta()

    def send_forward(self, hidden, mask, labels):
        """One forward piece of the current step -> (hidden or loss, (step, piece))."""
        piece = (self.step, self.pieces)
        self.pieces += 1
        tensors = pack(P.HIDDEN, hidden.detach(), self.cfg.wire_dtype)
        if mask is not None:
            tensors[P.MASK] = mask.detach().long().cpu()
        if labels is not None:
            tensors[P.LABELS] = labels.detach().long().cpu()
        out, _ = self._train_call(piece[0], Sent(P.TRAIN_FORWARD, tensors, self._meta(*piece)))
        if labels is not None:
            return out[P.LOSS].to(hidden.device).reshape(()), piece
        return unpack(out, P.HIDDEN).to(device=hidden.device, dtype=hidden.dtype), piece

    def send_backward(self, piece: tuple[int, int], grad: torch.Tensor, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """The backward of ``piece``: the gradient of its input; the server accumulates."""
        if grad.ndim == 0:  # 2-way: the scalar gradient of the loss, always float32
            tensors = {P.GRAD: grad.detach().float().reshape(1).cpu()}
        else:
            tensors = pack(P.GRAD, grad.detach(), self.cfg.wire_dtype)
        out, info = self._train_call(piece[0], Sent(P.TRAIN_BACKWARD, tensors, self._meta(*piece)))
        self._backward_done(piece, info)
        return unpack(out, P.GRAD).to(device=device, dtype=dtype)  # (B, T, d)

    def _backward_done(self, piece: tuple[int, int], info: dict) -> None:
        """Count an answered backward; the proxy's gradient becomes the server's norm over the
        most pieces accumulated (answers of pieces in flight together may come in any order)."""
        if piece[0] != self.step:
            return
        self.answered += 1
        accumulated = int(info.get("accumulated", self.answered))
        if accumulated < self._norm_pieces:
            return
        self._norm_pieces = accumulated
        self.server_norm = float(info["grad_norm"])
        if self.grad_proxy.requires_grad:
            value = torch.full_like(self.grad_proxy, self.server_norm)
            self.grad_proxy.grad = value
            self._proxy_set = value.clone()

    # -- pieces in flight together (micro-batch pipelining, :mod:`.pipeline`) ----------------

    def start_piece(self, kind: str, tensors: dict, lane: int, piece: Optional[tuple[int, int]] = None):
        """Send a forward (``kind`` "f": a new piece of the current step) or the backward of
        ``piece`` ("b") on transport ``lane`` without waiting; :meth:`finish_piece` reads it."""
        if kind == "f":
            piece = (self.step, self.pieces)
            self.pieces += 1
        sent = Sent(P.TRAIN_FORWARD if kind == "f" else P.TRAIN_BACKWARD, tensors, self._meta(*piece))
        try:
            pending = self.transport.start_call(sent.path, tensors, sent.meta, lane=lane)
        except (TransportError, ServiceUnavailable, Conflict):
            pending = None  # finish_piece sends it again, waiting and recovering as a lone call does
        return kind, piece, sent, pending

    def finish_piece(self, call) -> tuple[tuple[int, int], dict]:
        """The answer to :meth:`start_piece`'s call -> (its piece, the answer's tensors). A busy
        segment, a dropped connection or a restarted server: sent again as :meth:`send_forward`
        would (waits, replay of what the server lost; the numbers make it exactly once)."""
        kind, piece, sent, pending = call
        out = info = None
        if pending is not None:
            try:
                out, info = self.transport.finish_call_meta(pending)
                self._logged(piece[0], sent, out, info)
            except (TransportError, ServiceUnavailable, Conflict):
                out = None
        if out is None:
            out, info = self._train_call(piece[0], sent)
        if kind == "b":
            self._backward_done(piece, info)
        return piece, out

    def evaluate(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 labels: Optional[torch.Tensor] = None):
        """No-grad ``POST /v1/forward`` (server in eval mode, nothing changes): U-shape
        ``(trunk output, None)``; 2-way ``(logits (B, T, V), loss or None)``."""
        tensors = pack(P.HIDDEN, hidden.detach(), self.cfg.wire_dtype)
        if attention_mask is not None:
            tensors[P.MASK] = attention_mask.detach().long().cpu()
        if labels is not None:
            tensors[P.LABELS] = labels.detach().long().cpu()
        meta = {"wire_dtype": self.cfg.wire_dtype, "padding": "any"}
        if not self.u_shape:
            meta["logits"] = "all"
        if self.info.get("lora"):
            meta["client_id"] = self.client_id  # the server evaluates with this client's adapter
        out = self.transport.call(P.FORWARD, tensors, meta)
        if self.u_shape:
            return unpack(out, P.HIDDEN).to(device=hidden.device, dtype=hidden.dtype), None
        logits = unpack(out, P.LOGITS).to(device=hidden.device, dtype=hidden.dtype)
        loss = out[P.LOSS].to(hidden.device).reshape(()) if P.LOSS in out else None
        return logits, loss

    # -- sending, and recovering from a server crash (see .journal) -----------------------

    @property
    def recoveries(self) -> list[dict]:
        """One entry per recovery from a server restart: ``{"server_step", "replayed"}``."""
        return self.log.replays

    def _send_once(self, sent: Sent) -> tuple[dict, dict]:
        """One request (waiting out a segment busy with another client's step) -> (tensors, info)."""
        from ..client.federation import wait_while_busy

        if sent.tensors is None:  # an apply: JSON both ways
            return {}, self.transport.post_json(sent.path, sent.meta)
        return wait_while_busy(lambda: self.transport.call_meta(sent.path, sent.tensors, sent.meta),
                               "the segment", self.cfg.wait_timeout_s)

    def _train_call(self, step: int, sent: Sent) -> tuple[dict, dict]:
        """Send one training request; log it for a replay; if the server crashed and restarted
        behind this client (a dropped connection past the transport's retries, or a 409 from
        a server that lost steps), wait for it, replay what it lost, and send it again."""
        deadline = time.monotonic() + self.cfg.reconnect_timeout_s
        conflicts = 0
        while True:
            try:
                out, info = self._send_once(sent)
                break
            except TransportError as e:
                if not self.log.enabled:
                    raise
                log.warning("server unreachable (%s); waiting up to %gs", e.message, self.cfg.reconnect_timeout_s)
                self._wait_for_server(deadline)
            except Conflict:
                conflicts += 1
                if not self.log.enabled or conflicts > 1:
                    raise
            try:
                self._recover()
            except TransportError:
                if time.monotonic() > deadline:
                    raise
        self._logged(step, sent, out, info)
        return out, info

    def _logged(self, step: int, sent: Sent, out: dict, info: dict) -> None:
        if sent.tensors is not None and self.log.enabled:
            sent.answer = digest(out)
        self.log.record(step, sent)
        if "durable" in info:
            self.log.durable(int(info["durable"]))

    def _wait_for_server(self, deadline: float) -> None:
        while True:
            try:
                self.transport.get_json(P.HEALTH)
                return
            except TransportError:
                if time.monotonic() > deadline:
                    raise TransportError(f"the server at {self.cfg.server} did not come back within "
                                         f"{self.cfg.reconnect_timeout_s:g}s (reconnect_timeout_s)") from None
                time.sleep(0.5)

    def _recover(self) -> None:
        """Bring a restarted server back to this client's step: replay the logged requests of the
        steps it lost and of the step in progress (a server that lost nothing answers them from
        its ledger)."""
        state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        server = int(state["step"])
        if server >= self.step:  # it applied the step in progress: the apply's retry gets its answer
            return
        self.log.durable(min(int(state.get("durable", 0)), server))
        self.log.replay(server, self.step, lambda r: self._send_once(r)[0])

    # -- the optimizer step --------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Only ``optimizer``'s steps apply the server's step from now on (by default any
        optimizer over the model's parameters does); its ``zero_grad`` discards pending
        gradients on the server."""
        self._optimizer_ref = weakref.ref(optimizer)

    def _covers(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._optimizer_ref is not None:
            return self._optimizer_ref() is optimizer
        owner = self._owner_ref() if self._owner_ref is not None else None
        mine = {id(p) for p in (owner.parameters() if owner is not None else self.parameters())}
        return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])

    def _lr_of(self, optimizer: torch.optim.Optimizer) -> float:
        """The learning rate of the group holding :attr:`grad_proxy` (else the first group)."""
        for g in optimizer.param_groups:
            if any(p is self.grad_proxy for p in g["params"]):
                return float(g["lr"])
        return float(optimizer.param_groups[0]["lr"])

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The global hook: apply if ``optimizer`` trains this segment's model."""
        if (self.pieces == 0 and self.answered == 0) or not self._covers(optimizer):
            return
        if self.answered == 0:  # forwards with gradients on, never backpropagated: drop them
            self.discard_pending(force=True)
            return
        self._check_optimizer(optimizer)
        self.apply(self._lr_of(optimizer))

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once if the client's optimizer is not the server's kind (only the lr travels)."""
        if getattr(self, "_checked", None) is optimizer:
            return
        self._checked = optimizer
        server = self.info.get("optimizer", {})
        kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}.get(server.get("name"))
        wd = {float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups}
        if kind is not None and not isinstance(optimizer, kind) or wd != {float(server.get("weight_decay", 0.0))}:
            log.warning("the server steps its own %s (weight_decay %s) with this optimizer's learning rate; this "
                        "optimizer is %s (weight_decay %s): the two sides differ from one unsplit optimizer",
                        server.get("name"), server.get("weight_decay"), type(optimizer).__name__, sorted(wd))

    def clip_factor(self) -> float:
        """The factor the server's gradients must be multiplied by: what happened to the
        proxy's gradient since the last backward set it (1.0 if nothing did)."""
        g = self.grad_proxy.grad
        if g is None or self._proxy_set is None or not self.grad_proxy.requires_grad:
            return 1.0
        if torch.equal(g, self._proxy_set):
            return 1.0
        if float(self._proxy_set) == 0.0:
            return 1.0
        factor = float(g.double() / self._proxy_set.double())
        if not 0.0 < factor <= 1.0:
            raise ConfigError(f"the server's gradient was scaled by {factor} on the client (its proxy "
                              f"{self.grad_proxy.grad.item()} vs {self._proxy_set.item()}): only a "
                              f"clip (0 < factor <= 1) can be sent to the server")
        return factor

    def apply(self, lr: float) -> dict:
        """``POST /v1/train/apply`` of the current step at ``lr``; the next pieces belong to
        the next step. Returns the server's answer."""
        req = P.ApplyRequest(self.client_id, self.step, self.answered, float(lr), self.clip_factor())
        _, answer = self._train_call(self.step, Sent(P.TRAIN_APPLY, None, req.to_json()))
        self.last_apply, self.applies = answer, self.applies + 1
        self._next_step()
        return answer

    def discard_pending(self, force: bool = False) -> None:
        """Drop the current step's gradients on the server (``zero_grad`` before a step). Not
        while no backward has been answered (``loss = model(x); opt.zero_grad(); loss.backward()``
        keeps its forward) unless ``force``."""
        if self.answered == 0 and not (force and self.pieces):
            return
        req = P.ApplyRequest(self.client_id, self.step, discard=True)
        self.transport.post_json(P.TRAIN_APPLY, req.to_json())
        self.log.drop(self.step)
        self.pieces = self.answered = self._norm_pieces = 0
        self.server_norm = self._proxy_set = None

    def _next_step(self) -> None:
        self.step += 1
        self.pieces = self.answered = self._norm_pieces = 0
        self.server_norm = self._proxy_set = None
