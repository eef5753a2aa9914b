"""The causal-LM loss of a top segment computed in chunks of positions, so the (B, T, V) logits
never exist at once::

    x = norm(h)                                               # (B, T, d), as the segment does
    loss = sum over chunks c of CE_sum(x[c] @ W^T, y[c]) / n  # logits (rows_c, V), one chunk at a time

``n``: the targets that are not ``-100``. With gradients, each chunk's gradients of ``x`` and
``W`` are made in the forward while its logits exist. Design, cost and exactness:
docs/INTERNALS.md, 'What a request costs in memory'."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from .segments import loss_from_logits

IGNORE = -100
# Bytes of one chunk's float32 logits: above glibc's largest mmap threshold (32 MiB) on purpose
# (docs/INTERNALS.md, "glibc's mmap threshold").
CHUNK_LOGITS_BYTES = 64 << 20


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Positions per chunk: as many as fit ``chunk_bytes`` of float32 logits (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab))


def _chunk_grad(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, per_target: torch.Tensor):
    """Summed cross-entropy of one chunk and its gradient with respect to the logits, for an incoming
    gradient of ``per_target`` on each target's loss. x: (c, d); weight: (V, d); targets: (c,).
    Returns (loss_sum, grad_logits (c, V) in x's dtype)."""
    with torch.enable_grad():
        logits = (x @ weight.t()).detach().requires_grad_()  # (c, V)
        loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
        (grad,) = torch.autograd.grad(loss, logits, per_target)  # (c, V)
    return loss.detach(), grad


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum_c CE_sum(x[c] @ W^T, y[c]) / n, gradients made chunk by chunk in the forward for the
    incoming gradient ``scale`` (1, or a micro-batch's ``loss_scale``); a backward with another
    incoming gradient rescales them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                rows: int, scale: float) -> torch.Tensor:  # x (N, d), weight (V, d), targets (N,)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nf = (targets != IGNORE).sum().to(torch.float32)
        ctx.scale = torch.tensor(scale, dtype=torch.float32, device=x.device)
        per_target = ctx.scale / nf  # as cross-entropy's mean divides its incoming gradient
        grad_x = torch.empty_like(x) if need_x else None  # (N, d), every row written below
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for i in range(0, x.shape[0], rows):
            xc, tc = x[i:i + rows], targets[i:i + rows]  # (c, d), (c,)
            loss_c, g = _chunk_grad(xc, weight, tc, per_target)  # g (c, V)
            total += loss_c
            if need_x:
                torch.mm(g, weight, out=grad_x[i:i + rows])  # (c, d)
            if need_w:  # accumulated in float32 whatever the compute dtype
                grad_w.addmm_(g.t().float(), xc.float())  # (V, d)
            del g
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype) if need_w else None)
        return total / nf

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if getattr(ctx, "spent", False):  # the stored gradients may be rescaled in place: once only
            raise RuntimeError("the chunked head loss supports one backward per forward")
        ctx.spent = True
        grad_x, grad_w = ctx.saved_tensors
        if not torch.equal(grad_out.to(torch.float32), ctx.scale):  # not the gradient expected
            ratio = grad_out.to(torch.float32) / ctx.scale
            grad_x = None if grad_x is None else grad_x.mul_(ratio.to(grad_x.dtype))
            grad_w = None if grad_w is None else grad_w.mul_(ratio.to(grad_w.dtype))
        return grad_x, grad_w, None, None, None


def chunked_lm_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    rows: Optional[int] = None, grad_scale: float = 1.0) -> torch.Tensor:
    """Causal-LM loss of ``logits = x @ weight^T`` without materialising the logits.

    x: (B, T, d) after the final norm; weight: (V, d), no bias; labels: (B, T), -100 ignored. Shifts
    and averages as :func:`~splitlearn.model.segments.loss_from_logits`. ``rows``: positions per chunk
    (default :func:`chunk_rows`); ``grad_scale``: the s of ``(loss * s).backward()``, for exact
    gradients."""
    xs = x[:, :-1, :].reshape(-1, x.shape[-1])  # (B*(T-1), d)
    ys = labels[:, 1:].reshape(-1).to(x.device)  # (B*(T-1),)
    rows = rows or chunk_rows(weight.shape[0])
    if torch.is_grad_enabled() and (xs.requires_grad or weight.requires_grad):
        return _ChunkedHeadLoss.apply(xs, weight, ys, rows, float(grad_scale))
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for i in range(0, xs.shape[0], rows):  # no gradients: the losses only
        logits = xs[i:i + rows] @ weight.t()  # (c, V)
        total += F.cross_entropy(logits.float(), ys[i:i + rows], ignore_index=IGNORE, reduction="sum")
    return total / (ys != IGNORE).sum().to(torch.float32)


def head_loss(top: nn.Module, h: torch.Tensor, labels: torch.Tensor,
              rows: Optional[int] = None, grad_scale: float = 1.0) -> torch.Tensor:
    """The loss of a top (or full) segment from its last layer's output ``h`` (B, T, d): the final
    norm then :func:`chunked_lm_loss` on the head's weight (a LoRA segment's head is its base's).
    A head the chunks cannot express (a final logit softcap, Gemma 2's) computes its logits whole."""
    top = getattr(top, "base", top)
    x = top.head_hidden(h)  # (B, T, d)
    if top.arch.softcap is not None:
        return loss_from_logits(top.arch.logits(top.head_module, x), labels)
    head = top.head_module
    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked head loss needs an LM head without bias")
    return chunked_lm_loss(x, head.weight, labels, rows, grad_scale)
