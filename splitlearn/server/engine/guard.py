"""Poisoning guards: a training step that is not finite is refused before it changes anything.

Requests are checked for NaN/inf when decoded (:mod:`splitlearn.server.http.validate`), but finite values can still
break a model: activations of 3e38 overflow inside the first layer norm, and a gradient of
1e30 squares to inf in AdamW's second moment, which then freezes or NaNs the weights for
every client. So each training step is checked at three points, all *before* the optimizer
step, and a failing step is answered with 400 ``bad_request`` and leaves the segment's weights
and optimizer state exactly as they were (other clients never see it):

1. the forward's result (the trunk's output, or the top's loss) is finite;
2. the gradient sent back to the client is finite;
3. the global L2 norm of the parameter gradients, computed in float32, is finite.

Why (3) is enough for the update to be finite: a finite norm bounds every squared
gradient element below float32's maximum, so AdamW's moments stay finite and its step is
bounded by the learning rate (Loshchilov & Hutter 2019, Algorithm 2), and SGD's step
``lr * g`` is finite. ``--max-grad-norm`` additionally clips that norm (Pascanu et al. 2013).

On a GPU every host read of a device value (``bool(t)``, ``float(t)``, ``.cpu()``) waits for the
device's queue to drain, and every op is a kernel launch. So the checks of a step are flags left
on the device and read back together with the values the host needs (the norm, the loss, the
tokens trained), one small tensor, once: :func:`settle`. A piece reads twice: its request's
checks before the segment runs (a refused request must not draw dropout's random numbers, open
the step or add to its gradients), then (1)-(3) after its backward. A fused 2-way step
(``/v1/train/step``) therefore backpropagates a loss that is not finite before refusing it; the
refusal aborts the whole step (its gradients zeroed), as a refused piece always did. The norm is one ``_foreach_norm`` over
all the gradients (in float32 whatever their dtype): a constant number of ops, whatever the
number of parameters (tests/test_server_syncs.py counts both).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

from ...errors import BadRequest

_SQRT_F32_MAX = math.sqrt(torch.finfo(torch.float32).max)  # ~1.8e19


NOT_FINITE_NORM = ("refused: the step's parameter gradients are not finite (their norm "
                   "overflows float32); nothing was changed")


def refusal(what: str) -> str:
    return f"refused: {what} is not finite (NaN or inf); nothing was changed"


def finite_flag(x: torch.Tensor) -> torch.Tensor:
    """``x`` holds no NaN or inf: a 0-dim bool left where ``x`` is (no read)."""
    return torch.isfinite(x.detach()).all()


def finite(what: str, x: torch.Tensor) -> None:
    """Raise 400 naming ``what`` if ``x`` holds NaN or inf (one read)."""
    settle([(finite_flag(x), refusal(what))])


def norm_tensor(params: Iterable[torch.nn.Parameter]) -> Optional[torch.Tensor]:
    """The global L2 norm of the parameters' gradients, float32, 0-dim, left on their device
    (None: no gradients). Three ops whatever the number of parameters: one ``_foreach_norm``
    (each gradient's norm accumulated in float32, no float32 copy of a low-precision gradient),
    then the norm of those norms."""
    grads = [p.grad for p in params if p.grad is not None]  # no .detach(): an op each
    if not grads:
        return None
    with torch.no_grad():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # one norm per tensor
        return torch.linalg.vector_norm(torch.stack(norms))


def checked_norm(total: float) -> float:
    """``total`` (a norm read back), or 400 if its square does not fit in float32."""
    if not math.isfinite(total) or total > _SQRT_F32_MAX:
        raise BadRequest(NOT_FINITE_NORM)
    return total


def settle(flags: Sequence[tuple[torch.Tensor, str]], values: Sequence[Optional[torch.Tensor]] = ()) -> list:
    """Read the checks ``flags`` (0-dim bools, each with its refusal) and the scalar ``values``
    back to the host in one copy; raise the first failing flag's refusal (400), in order; else
    the values as Python floats (float64 holds a float32 or an int below 2**53 exactly; a None
    value stays None)."""
    parts = [f.reshape(1) for f, _ in flags] + [v.detach().reshape(1) for v in values if v is not None]
    if not parts:
        return [None for _ in values]
    host = torch.cat([p.to(torch.float64) for p in parts]).cpu().tolist()  # the one read
    for ok, (_, why) in zip(host, flags):
        if not ok:
            raise BadRequest(why)
    read = iter(host[len(flags):])
    return [None if v is None else next(read) for v in values]


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The global L2 norm of the parameters' gradients (float32); 400 if it is not finite (one read)."""
    (total,) = settle([], [norm_tensor(params)])
    return 0.0 if total is None else checked_norm(total)
