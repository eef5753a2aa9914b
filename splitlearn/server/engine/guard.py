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
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ...errors import BadRequest

_SQRT_F32_MAX = math.sqrt(torch.finfo(torch.float32).max)  # ~1.8e19


def finite(what: str, x: torch.Tensor) -> None:
    """Raise 400 naming ``what`` if ``x`` holds NaN or inf."""
    if not bool(torch.isfinite(x.detach()).all()):
        raise BadRequest(f"refused: {what} is not finite (NaN or inf); nothing was changed")


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The global L2 norm of the parameters' gradients (float32); 400 if it is not finite."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm([g.float() for g in grads])  # one norm per tensor
    total = float(torch.linalg.vector_norm(torch.stack(norms)))
    if not math.isfinite(total) or total > _SQRT_F32_MAX:  # its square must fit in float32
        raise BadRequest("refused: the step's parameter gradients are not finite (their norm "
                         "overflows float32); nothing was changed")
    return total
