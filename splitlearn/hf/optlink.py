"""The client's optimizer, linked to the server's step: which optimizer applies, at what
learning rate, with what clip, and a ``zero_grad`` seen on both sides.

``optimizer.step()`` of the optimizer holding :attr:`OptimizerLink.proxy` (found at the first
backward) or of the one given to :meth:`OptimizerLink.attach` triggers the apply (that
optimizer's own ``register_step_post_hook``: nothing of ``torch.optim`` is replaced), with its
*current* learning rate, so LR schedules drive both sides (``SplitClient`` fixes the rate at
the server's own: :attr:`OptimizerLink.fixed_lr`). A ``zero_grad`` (any optimizer's, whatever its
class does, or the model's) between a backward and the step shows as the proxy's gradient gone:
the next piece, the step or a sync first discards the step's pieces on the server
(``{"discard": true}``).

**Which optimizers.** Every live optimizer over the model's parameters applies, each with its
own learning rate: the ones found at the first backward, and any made later (a re-created
optimizer, a second ``Trainer`` run, while the first is still alive or not). One not hooked yet
shows as the proxy (frozen by peft: a trainable parameter) moved with the step still pending;
the next piece, flush, sync or ``close`` searches again, hooks it and applies its step (so its
``zero_grad`` right after the step discards nothing); its later steps apply at once. The first
one, stepping again, still applies. An optimizer stepped and dropped at once
(``torch.optim.SGD(model.parameters(), lr).step()``) is gone before it can be found: a warning
naming ``model.attach_optimizer(opt)``, and the server does not step (its gradients stay
pending until the next ``zero_grad`` discards them). With :meth:`OptimizerLink.attach`, only
that optimizer applies while it lives; another stepping is warned about (the server does not
step); once it is collected, the optimizers over the model apply again.

**Gradient clipping across both sides.** The server's gradient is represented on the client
by one parameter, the segment's ``grad_proxy`` (shape ``[1]``), whose ``.grad`` each backward
sets to the L2 norm of the server's accumulated parameter gradients
(:meth:`OptimizerLink.server_norm_is`). So ``torch.nn.utils.clip_grad_norm_(model.parameters(),
max_norm)`` (what ``Trainer`` and accelerate call) computes the *global* norm over both sides
and scales the proxy like every other gradient; the apply then sends the factor the proxy was
scaled by (:meth:`OptimizerLink.clip_factor`) and the server multiplies its gradients by it
before stepping: the same clip as the unsplit model. Any other uniform scaling of gradients
(``loss * k`` before backward is already exact) reaches the server the same way. The proxy's
value is never used (the optimizer moves it).
"""
from __future__ import annotations

import gc
import logging
import weakref
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError

log = logging.getLogger(__name__)


def optimizers_holding(params) -> list:
    """The live ``torch.optim`` optimizers with one of ``params`` in their ``param_groups``
    (found through the garbage collector's referrers: a group's ``params`` list, the group,
    ``param_groups``, the optimizer; four scans). Nothing of torch is patched; called once per
    training run of a model whose optimizer was not attached (:meth:`OptimizerLink.attach`)."""
    params = list(params)
    if not params:
        return []
    lists = [r for r in gc.get_referrers(*params) if type(r) is list]
    if not lists:
        return []
    groups = [r for r in gc.get_referrers(*lists) if type(r) is dict and any(r.get("params") is x for x in lists)]
    if not groups:
        return []
    holders = [r for r in gc.get_referrers(*groups) if type(r) is list]
    if not holders:
        return []
    found = []
    for owner in gc.get_referrers(*holders):
        candidates = [owner] if isinstance(owner, torch.optim.Optimizer) else \
            [o for o in gc.get_referrers(owner) if isinstance(o, torch.optim.Optimizer)] if type(owner) is dict else []
        for opt in candidates:
            if any(opt.param_groups is h for h in holders) and all(opt is not f for f in found):
                found.append(opt)
    return found


class OptimizerLink:
    """The optimizers whose steps apply the segment's step, and the gradient proxy.

    ``segment``: the :class:`~splitlearn.hf.remote.RemoteSegment` (held weakly): its step
    (:attr:`~.pieces.StepPieces`), its apply (:class:`~.applies.Applier`) and its journal
    (:class:`~.recovery.Recovery`) are what an optimizer's step drives.
    """

    def __init__(self, segment, proxy: nn.Parameter):
        self._segment = weakref.proxy(segment)
        self.proxy = proxy  # .grad: the server's gradient norm
        self.fixed_lr: Optional[float] = None  # every apply at this lr, not the optimizer's (SplitClient: the server's)
        self._proxy_set: Optional[torch.Tensor] = None  # the value the last backward gave it
        self._proxy_grad: Optional[torch.Tensor] = None  # the .grad tensor the last backward gave the proxy
        self._proxy_version: Optional[int] = None  # the proxy's version counter then
        self._watched: list = []  # (the proxy frozen) (trainable parameter, its version counter then)
        self._optimizer_ref = None  # attach(): only this one triggers the apply
        self._owner_ref = None  # the model whose parameters identify its optimizers
        self._hooked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its step hook
        self._searched: Optional[int] = None  # the step the collector was last searched at
        self._checked = None  # (weakly) the optimizer last compared with the server's

    # -- which optimizer -----------------------------------------------------------------

    def bind(self, model: nn.Module) -> None:
        """The model the segment belongs to: an optimizer over any of its parameters applies."""
        self._owner_ref = weakref.ref(model)

    @property
    def owner(self) -> Optional[nn.Module]:
        """The model :meth:`bind` named (None: unbound or collected)."""
        return self._owner_ref() if self._owner_ref is not None else None

    @property
    def attached(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer :meth:`attach` named, if it is alive."""
        return self._optimizer_ref() if self._optimizer_ref is not None else None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Only ``optimizer``'s steps apply the server's step from now on, while it lives (another
        optimizer stepping is warned about; by default, and once it is collected, every optimizer
        over the model's parameters does: the module docstring); with a journal on disk
        and no checkpoint yet, the step-0 client checkpoint a resume starts from."""
        self._optimizer_ref = weakref.ref(optimizer)
        self._hook(optimizer)
        seg = self._segment
        if seg.journal.on_disk and seg.steps.pieces == 0:
            from ..model.checkpoint import has_state

            if not has_state(seg.log.directory, "client"):
                seg.journal.persist(optimizer)  # where a resume starts if nothing later is durable

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.register_step_post_hook``: its steps apply this segment's (per instance:
        nothing of ``torch.optim`` is replaced)."""
        if optimizer in self._hooked:
            return
        me = weakref.ref(self)

        def after_step(opt, args, kwargs):
            link = me()
            if link is not None:
                link.after_step(opt)

        self._hooked[optimizer] = optimizer.register_step_post_hook(after_step)

    def find(self, step: int) -> None:
        """At a backward of ``step``: hook the optimizers holding the proxy unless one is hooked."""
        if self.attached is not None or len(self._hooked) or self._searched == step:
            return
        self._searched = step  # once a step (four scans of the collector's objects)
        owner = self.owner
        params = [self.proxy] + [p for p in (owner.parameters() if owner is not None else ())
                                 if p.requires_grad and p is not self.proxy]
        for optimizer in optimizers_holding(params):
            self._hook(optimizer)

    def _covers(self, optimizer: torch.optim.Optimizer) -> bool:
        """Its steps apply: any optimizer's unless one attached is alive (one collected: found again)."""
        attached = self.attached
        return attached is None or attached is optimizer

    # -- the proxy and zero_grad ---------------------------------------------------------

    def server_norm_is(self, norm: float) -> None:
        """A backward's answer: the proxy's gradient becomes the server's accumulated norm."""
        if self.proxy.requires_grad:
            value = torch.full_like(self.proxy, norm)
            self.proxy.grad = value
            self._proxy_grad, self._proxy_set = value, value.clone()
            self._proxy_version = self.proxy._version  # an optimizer's step moves it
        else:  # (peft froze it) what an optimizer's step moves: the trainable parameters
            self._watched = self._versions()

    def _versions(self) -> list:
        owner = self.owner
        return [(p, p._version) for p in (owner.parameters() if owner is not None else ()) if p.requires_grad]

    def _moved(self) -> bool:
        """An optimizer stepped since this step's last backward (the proxy, or with it frozen a
        trainable parameter, was changed in place)."""
        if not self.proxy.requires_grad:
            return any(p._version != v for p, v in self._watched)
        return self._proxy_version is not None and self.proxy._version != self._proxy_version

    def forget(self) -> None:
        """The step ended or was dropped: no backward of the next has set the proxy yet."""
        self._proxy_set = None

    def zeroed(self) -> bool:
        """The client's gradients were cleared since this step's last backward (an optimizer's
        or the model's ``zero_grad``, whatever its class does): the proxy's gradient is gone, or
        zero where the server's norm was not."""
        if self._segment.steps.answered == 0:
            return False
        if not self.proxy.requires_grad:  # (peft froze it): the hooked optimizers' gradients all gone
            opts = [o for o in self._hooked.keys() if self._covers(o)]
            return bool(opts) and all(p.grad is None for o in opts for g in o.param_groups for p in g["params"])
        if self._proxy_set is None:
            return False
        g = self.proxy.grad
        return g is None or (g is not self._proxy_grad and not torch.equal(g, self._proxy_set)) or \
            (float(self._proxy_set) != 0.0 and not bool(g.any()))

    def notice_zero_grad(self) -> None:
        """Before a new piece, a sync or an apply: the step of an optimizer not hooked yet (made
        after the step's backward, or while another one already was: a re-created optimizer) is
        applied now; a ``zero_grad`` since the last backward discards the step's pending
        gradients on the server too."""
        if self._late_step():
            return
        if self.zeroed():
            self._segment.steps.discard()

    def _late_step(self) -> bool:
        """The proxy moved since this step's backward with no hooked optimizer's step seen
        (their hook applies the step and ends it): an optimizer not hooked stepped. Search again,
        hook what is new and apply its step (a ``zero_grad`` after it is no discard) -> True;
        found none (stepped and gone at once): warn, the server does not step -> False."""
        steps = self._segment.steps
        if not steps.answered or not self._moved():
            return False
        self._proxy_version, self._watched = self.proxy._version, self._watched and self._versions()  # (once a move)
        if self.attached is not None:
            log.warning("an optimizer other than the one given to model.attach_optimizer(opt) stepped this model's "
                        "parameters: the server did not step (step %d), only the client did. Attach the optimizer "
                        "that steps (model.attach_optimizer(new_opt))", steps.step)
            return False
        hooked = set(map(id, self._hooked.keys()))
        owner = self.owner
        params = [self.proxy] + [p for p in (owner.parameters() if owner is not None else ())
                                 if p.requires_grad and p is not self.proxy]
        late = [o for o in optimizers_holding(params) if id(o) not in hooked]
        self._searched = steps.step
        for optimizer in late:
            self._hook(optimizer)
        if late:
            self._stepped(late[0])
            return True
        log.warning("an optimizer stepped this model's parameters and was gone before its step could be found "
                    "(e.g. torch.optim.SGD(model.parameters(), lr).step() on an optimizer not kept): the server "
                    "did not step (step %d), only the client did. Keep one optimizer for the run, or name it "
                    "with model.attach_optimizer(opt)", steps.step)
        return False

    # -- the optimizer's step ------------------------------------------------------------

    def lr_of(self, optimizer: torch.optim.Optimizer) -> float:
        """:attr:`fixed_lr`, else the learning rate of the group holding the proxy (else the first group)."""
        if self.fixed_lr is not None:
            return self.fixed_lr
        for g in optimizer.param_groups:
            if any(p is self.proxy for p in g["params"]):
                return float(g["lr"])
        return float(optimizer.param_groups[0]["lr"])

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step hook: apply the server's step (at :meth:`lr_of` ``optimizer``)."""
        steps = self._segment.steps
        if (steps.pieces == 0 and steps.answered == 0) or not self._covers(optimizer):
            return
        if self.zeroed():  # (not notice_zero_grad: this step moved the proxy, no other optimizer to find)
            steps.discard()
        if steps.pieces:
            self._stepped(optimizer)

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        seg = self._segment
        if seg.steps.answered == 0:  # forwards with gradients on, never backpropagated: drop them
            seg.steps.discard(force=True)
            return
        if self.fixed_lr is None:  # (a fixed lr is the server's own: nothing to compare)
            self._check_optimizer(optimizer)
        seg.applier.apply(self.lr_of(optimizer))
        seg.journal.after_apply(optimizer)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once if the client's optimizer is not the server's kind (only the lr travels)."""
        if self._checked is not None and self._checked() is optimizer:
            return
        self._checked = weakref.ref(optimizer)  # (weakly: a replaced optimizer must be collectable)
        server = self._segment.info.get("optimizer", {})
        kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}.get(server.get("name"))
        wd = {float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups}
        if kind is not None and not isinstance(optimizer, kind) or wd != {float(server.get("weight_decay", 0.0))}:
            log.warning("the server steps its own %s (weight_decay %s) with this optimizer's learning rate; this "
                        "optimizer is %s (weight_decay %s): the two sides differ from one unsplit optimizer",
                        server.get("name"), server.get("weight_decay"), type(optimizer).__name__, sorted(wd))

    def clip_factor(self) -> float:
        """The factor the server's gradients must be multiplied by: what happened to the
        proxy's gradient since the last backward set it (1.0 if nothing did)."""
        g = self.proxy.grad
        if g is None or self._proxy_set is None or not self.proxy.requires_grad:
            return 1.0
        if torch.equal(g, self._proxy_set):
            return 1.0
        if float(self._proxy_set) == 0.0:
            return 1.0
        factor = float(g.double() / self._proxy_set.double())
        if not 0.0 < factor <= 1.0:
            raise ConfigError(f"the server's gradient was scaled by {factor} on the client (its proxy "
                              f"{self.proxy.grad.item()} vs {self._proxy_set.item()}): only a "
                              f"clip (0 < factor <= 1) can be sent to the server")
        return factor
