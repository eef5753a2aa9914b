"""What one request may cost in memory, and the cost model that decides it before allocating.

A request's tensors are bounded by ``--max-body-mb``, but what the server computes from them
is not: 64 rows x 1024 positions of GPT-2 small's top make 64 x 1024 x 50257 x 4 B = 13 GB of
logits alone. Every route that allocates by request size asks :meth:`Budget.check` first,
right after its shapes are validated; a request over the limit gets 413 naming the limit and
the flag that raises it, and nothing is allocated or changed.

The model (bytes; B rows, T new positions, K = past + T keys, N = B·T, d = hidden_size, I = the
MLP's width (GPT-2: 4d), a = num_attention_heads, V = vocab, L = the segment's blocks, e = bytes per
element of the compute dtype, c = the loss's chunk of positions, 64 MiB of float32 logits)::

    kept per block (training)  e·N·(5I + 7d + a + 4)                     sdpa (flash), no dropout
                               + e·B·T·K                                 padded: sdpa's float mask
                               + N·d·(2e + 2)                            residual dropout
                               + B·a·T·K·(3e + 1)                        scores materialised (CPU)
                  on CUDA      e·N·(5I + 8d) + 16·N + 4·N·a              the output; float32 LN stats, lse
                               [+ 2·N·d + 1 KiB]                         dropout: bool masks, RNG state
    block workspace            e·N·(4I + 6d) [+ (1 + e)·B·T·K masked] [+ 3e·B·a·T·K scores]
                               [+ 4·N·(d + a) on CUDA]                   the fused backward's accumulators
    head, training             4·e·N·d + 4·V·d + c·V·16                  x, grad of x; grad of W; a chunk
                  on CUDA      3·e·N·d + 4·V·d + c·V·16                  the final norm's input is in kept
    head, evaluation           B·V·(e + 4) [+ 2·e·N·d + c·V·8 with labels]
    update (training)          grads + 2·largest parameter               AdamW's temporaries (CPU)
                  on CUDA      grads + max(grads, 4·grads/e if e < 4)    foreach temporaries, or the norm's copies
    KV cache                   2·L·tokens·d·e   (other families: 2·KV heads·head_dim per layer, a
                                                 sliding layer's rows at most its window)
    in and out                 16·N·d                                    body, decoded, answer, encoded
                  on CUDA      (3e + 8)·N·d                              bodies in host memory

    training step    (L·kept + workspace + head + update + in/out) x 1.25
           on CUDA   (max(L·kept + max(head, backward), update) + in/out) x 1.1
                     backward = workspace + grads [+ e·N·d, the head's grad of x]
    forward          (e·N·d + workspace + head + in/out) x 1.25
    session step     (KV(rows·K) + one block's K, V copy + workspace + last logits + in/out) x 1.25
    session open     KV(min(rows·max_position_embeddings, --max-tokens-per-client))

(16-bit compute adds the float32 copies of the logits and gradients it makes.) Other families'
layers (a gated MLP of width I, q/KV heads x head_dim, their norms, eager or sdpa attention) are
counted in :mod:`.layercost` in place of the block's kept and workspace terms. The kept
activations are the per-layer count of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", arXiv:2205.05198, eq. 2: s·b·h·(34 + 5·a·s/h)
bytes at 16 bits) redone for what this code runs, by counting the tensors autograd saves in a
GPT-2 block of transformers 5 (``saved_tensors_hooks``; equal for every shape tried):

- GPT-2's ``gelu_new`` is written in Python (``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``),
  so the MLP keeps five (B, T, I) tensors, not a fused GeLU's one: 5I + 7d values per
  position (27d at I = 4d), against the paper's 34 bytes per h at 16 bits;
- the attention is ``scaled_dot_product_attention`` (sdpa); on CPU its flash kernel keeps no
  (B, a, T, K) scores, only a log-sum-exp (a per position), but a padding mask reaches it as
  a boolean that sdpa turns into a float (B, 1, T, K) tensor in every call, kept for the
  backward. With attention dropout in training (GPT-2's configs: 0.1) the CPU kernel falls
  back to the math path, which keeps the scores, the softmax and the dropped-out softmax with
  its mask: the paper's 5·a·s/h term, at 3e + 1 bytes a score;
- the head's loss is computed in chunks of c positions (:mod:`splitlearn.model.headloss`): one
  chunk's logits, log-softmax and their gradients at a time, plus the gradients of x and W;
  a forward computes the last position's logits only.

On a CUDA device (``Dims.of(..., device)``) these things differ, and the model follows
(``Dims.cuda_kernels``, ``Dims.cuda``):

- sdpa runs the flash or memory-efficient kernel (16-bit compute, or float32 for the
  memory-efficient one; a head size that is a multiple of 8, at most 256), and both take
  attention dropout themselves: no (B, a, T, K) scores are kept, dropout included. What the
  kernel keeps beyond q, k, v and its output is the float32 log-sum-exp (B, a, T) (4 bytes a
  value whatever e is) and the dropout's RNG state (a seed and an offset, priced as two of
  the caching allocator's 512-byte blocks). Its backward's float32 accumulator for the
  gradient of q and the (B, a, T) softmax sums join the block's workspace (4·N·(d + a));
- the residual dropout is CUDA's fused kernel, whose mask is bool (the CPU's keeps a mask in
  the compute dtype), and layer norm keeps its mean and 1/std in float32; the block's output,
  which the next block's ln_1, the final norm or the answer keeps, is counted in the block;
- AdamW takes torch's foreach path (its default for CUDA tensors), which makes one
  temporary of every parameter's size at once (``torch._foreach_sqrt`` of the second
  moments), after the step's norm has freed its float32 copies of 16-bit gradients: the
  update is the gradients and the larger of the two, not the gradients and twice the
  largest parameter;
- the caching allocator hands the blocks a phase freed to the next one, where glibc keeps a
  freed heap in the RSS: a training step is priced at the largest of its phases, not their
  sum: the head's forward (the kept activations, then the chunked loss with its gradients,
  :mod:`splitlearn.model.headloss`), the backward (the kept activations, one block's
  workspace, the gradients) and the update; with a slack of 1.1 (``CUDA_SLACK``), not 1.25;
- the request bodies and the encoded answers are host memory; on the device are the input,
  the gradient of the input and the output or the gradient coming back (a U-shape backward
  holds all three until it returns), and the answers' tensors in float32 until the apply.

Measured: the GPU test's 2-way step (d = 768, 3 blocks + GPT-2's head, bfloat16, 8 x 1024,
GPT-2's dropouts) peaked on an H100 at 1.43 GiB of ``torch.cuda.max_memory_allocated()``:
the head's forward: 1.02 GiB of kept activations + 0.05 GiB of (B, T, d) tensors (the input,
the final norm's output, the shifted copy, grad of x) + 0.14 GiB for grad of W in float32 + 0.22 GiB
for one chunk of the loss (14 bytes a logit at once in bfloat16) = 1.430 GiB, the tensors
the same route keeps on the CPU (``tests/tensorpeak.py``: live storages of the operators'
outputs; a 2 x 256 step, per position) with CUDA's bool masks and float32 statistics.
Adding the backward's workspace, every gradient and the host-memory bodies to that peak
priced it at 2.25 GiB (1.57x); by phase it is 1.75 GiB (1.23x; the chunk still priced at 20
bytes a logit).

So GPT-2 XL, 2-way, 8 x 1024 positions, bfloat16 is priced at 134.83 GiB on the CPU (46 blocks
of 1.47 GB of scores each) and 39.79 GiB on CUDA.

The 1.25 is the allocator's slack (``ALLOCATOR_SLACK``): glibc serves the (B, T, d) tensors of
moderate batches from heaps that fragment. The totals are checked against peaks measured on
CPU (peak RSS of the route through Flask's test client, in a fresh process:
``benchmarks/request_memory.py``, docs/INTERNALS.md "What a request costs in memory"): 1.04 to
1.8 times the measured peak, never below it. Training with ``/v1/train/forward`` is charged at
the forward for its backward too (the step's other pieces' waiting graphs are reserved one by
one, see below).

The default limit (no ``--max-request-memory-gb``) is derived at start from the memory this
process can still get (:func:`available_memory`) minus what the segment's training state
will still take (gradients, optimizer moments, generation's prepacked weight copy, made on
the CPU only), halved on the CPU: the other half is for what runs beside the one request
computing (bodies read by other WSGI threads, U-shape graphs waiting for their backward,
generation caches, the allocator's slack), and the memory account's total is twice the limit.
A request the machine cannot hold is then refused instead of killing the server.

On a CUDA device the rest is not halved, and the account's total is that same rest: one
request computes at a time (the compute thread), its price carries its own allocator slack,
what waits beside it on the device (U-shape graphs, KV caches) is reserved in the same
account, and bodies and stored answers live in host memory. Halving there refused GPT-2 XL's
8 x 1024 bfloat16 step on an 80 GB H100 (28.71 GiB allowed) whose unsplit twin runs on that
GPU. The free memory is read at start: a GPU shared with other processes (a client on the
same card) needs ``--max-request-memory-gb`` and ``--max-memory-gb`` set by hand.

What outlives a request, or waits beside the one computing (bodies, waiting graphs priced
one by one with :func:`graph_bytes`, stored answers, KV caches), is reserved in the
server-wide :class:`~.memory.MemoryAccount`, per tenant and in total; :meth:`Budget.check`
also reserves the request's price there while it is served.
"""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ...errors import PayloadTooLarge
from ...model.arch import SLIDING, mlp_width
from ...model.headloss import CHUNK_LOGITS_BYTES, chunk_rows
from ...model.packed import usable
from . import layercost
from .layercost import LayerShape
from .memory import HOST_SHARE, TOTAL_FLAG, MemoryAccount, body_limits, charge

log = logging.getLogger(__name__)

FLAG = "--max-request-memory-gb"
GiB = 1 << 30
MIN_DERIVED = 64 << 20  # the derived limit never goes below this (a warning says why it is low)
# A route's price is the tensor bytes counted below times this: the allocator's slack. glibc
# serves allocations under its mmap threshold (up to 32 MiB) from heaps that fragment as
# (B, T, d) tensors come and go; GPT-2 small's prefill of 8 x 512 peaked at up to 1.2x
# the tensors counted (docs/INTERNALS.md, "What a request costs in memory").
ALLOCATOR_SLACK = 1.25
# On CUDA the caching allocator rounds to 512 B blocks and splits its segments, and freed blocks
# serve the next tensors of the same process: a smaller slack, and a step's phases priced as the
# largest one rather than their sum. A GPT-2-shaped 2-way step on an H100 peaked at 1.43 GiB of
# torch.cuda.max_memory_allocated(), what its tensors count at that peak (module docstring).
CUDA_SLACK = 1.1


@dataclass(frozen=True)
class Dims:
    """What a request's memory depends on, besides its shape."""

    d: int  # config.hidden_size
    heads: int  # config.num_attention_heads
    inner: int  # the MLP's width (splitlearn.model.arch.mlp_width; GPT-2: 4d by default)
    vocab: int
    blocks: int  # blocks the segment holds
    head: bool  # the segment holds the final norm + the LM head (a top)
    elem: int  # bytes per element of the compute dtype
    eager: bool  # attention materialises (B, a, T, K) scores always (not sdpa)
    attn_dropout: bool  # attention dropout in training: sdpa on CPU falls back to the math path (scores)
    dropout: bool  # residual dropout in training (outputs and masks kept)
    grads: int = 0  # bytes of the gradients a training step makes (its trainable parameters)
    largest: int = 0  # bytes of the largest trainable parameter (the optimizer's temporaries)
    # sdpa runs CUDA's flash / memory-efficient kernels: no scores kept, dropout included
    cuda_kernels: bool = False
    # on a CUDA device: AdamW's foreach path; the caching allocator reuses the backward's blocks
    cuda: bool = False
    # bytes of one cached position's keys and values over the segment's layers (the adapter's
    # 2 x num_key_value_heads x head_dim per layer, docs/MODELS.md; sliding layers priced as full:
    # an upper bound); 0: 2·d per layer
    kv_token: int = 0
    # sliding layers' bytes of one cached position (in kv_token too); a row holds at most `window`
    kv_sliding: int = 0
    window: int = 0  # config.sliding_window (0: none)
    layer: Optional[LayerShape] = None  # another family's layer (.layercost); None: GPT-2's formulas

    @classmethod
    def of(cls, segment: nn.Module, dtype: torch.dtype, device: Union[torch.device, str] = "cpu") -> "Dims":
        """The segment's dimensions as it computes in ``dtype`` on ``device``; its trainable
        parameters now (a LoRA server's base is frozen)."""
        c = segment.config
        attn = getattr(c, "_attn_implementation", None) or "eager"
        sizes = [p.numel() * p.element_size() for p in segment.parameters() if p.requires_grad]
        cuda = torch.device(device).type == "cuda"
        d, heads = c.hidden_size, c.num_attention_heads  # any family's config (docs/MODELS.md)
        elem = torch.empty((), dtype=dtype).element_size()
        arch = getattr(segment, "arch", None)  # KV bytes per token: 2 x KV heads x head_dim per layer
        per_type = arch.kv_bytes_per_token(elem, segment.start, segment.end) if arch else {}
        window = int(getattr(c, "sliding_window", None) or 0)
        return cls(d=d, heads=heads, inner=mlp_width(c), vocab=c.vocab_size,
                   blocks=len(segment.layers_list), head=segment.has_head,
                   elem=elem,
                   eager=attn != "sdpa", attn_dropout=getattr(c, "attn_pdrop", getattr(c, "attention_dropout", 0)) > 0,
                   dropout=getattr(c, "resid_pdrop", getattr(c, "hidden_dropout", 0)) > 0,
                   grads=sum(sizes), largest=max(sizes, default=0),
                   cuda_kernels=cuda and attn == "sdpa" and fused_sdpa(dtype, d // heads),
                   cuda=cuda, kv_token=sum(per_type.values()), kv_sliding=per_type.get(SLIDING, 0) if window else 0,
                   window=window, layer=LayerShape.of(segment))

    @property
    def scores(self) -> bool:
        """Training materialises the attention scores: eager attention, or dropout on a kernel
        that takes none (the CPU's flash kernel; CUDA's take it)."""
        return self.eager or (self.attn_dropout and not self.cuda_kernels)

    @property
    def chunk_rows(self) -> int:
        return chunk_rows(self.vocab, CHUNK_LOGITS_BYTES)


def fused_sdpa(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether sdpa on a CUDA device runs a fused kernel that keeps no scores, dropout
    included: flash (16-bit) or memory-efficient (16-bit or float32), each needing a head
    size that is a multiple of 8 (at most 256 for flash; priced as the bound for both), as
    torch's dispatcher checks (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``)."""
    enabled = torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
    return (enabled and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and head_dim % 8 == 0 and head_dim <= 256)


# -- the cost model (bytes) ----------------------------------------------------------------

LSE_BYTES = 4  # CUDA's fused kernels keep their log-sum-exp in float32
RNG_STATE_BYTES = 2 * 512  # their dropout's seed and offset: two of the caching allocator's blocks
LN_STATS_BYTES = 4  # CUDA's layer norm keeps its mean and 1/std in float32 (the compute dtype's accumulator)


def kept_per_block(m: Dims, B: int, T: int, K: int, padded: bool) -> int:
    """Bytes one block keeps for the backward in training: B rows, T positions, K keys."""
    e, N = m.elem, B * T
    if m.layer is not None:
        return e * N * layercost.kept(m.layer, m.d, m.inner, m.heads, K, padded, m.eager)
    b = e * N * (5 * m.inner + 7 * m.d)
    if m.cuda:  # ln_1's and ln_2's mean and 1/std; the block's output, kept by what reads it next
        b += 2 * 2 * LN_STATS_BYTES * N + e * N * m.d
    else:
        b += e * N * 4
    b += N * m.heads * (LSE_BYTES if m.cuda_kernels else e)  # sdpa's log-sum-exp, (B, a, T)
    if m.cuda_kernels and m.attn_dropout:
        b += RNG_STATE_BYTES  # the kernel replays its dropout from the RNG state: no mask kept
    if padded:
        b += e * B * T * K  # the float mask sdpa makes of the boolean one, kept by the kernel
    if m.dropout and m.cuda:
        b += 2 * N * m.d  # two residual dropouts' masks, bool on CUDA (the output is counted above)
    elif m.dropout:
        b += N * m.d * (2 * e + 2)  # two residual dropouts: masks in the compute dtype, and the output
    if m.scores:
        b += B * m.heads * T * K * (3 * e + 1)  # scores, softmax, dropped-out softmax + mask
    return b


def block_workspace(m: Dims, B: int, T: int, K: int, masked: bool, scores: bool) -> int:
    """Bytes one block needs beyond what it keeps, while it runs (forward or backward);
    ``masked``: sdpa gets a mask tensor (padding, or new positions after cached ones)."""
    e, N = m.elem, B * T
    if m.layer is not None:
        return e * N * layercost.workspace(m.layer, m.d, m.inner, m.heads, K, masked, scores)
    b = e * N * (4 * m.inner + 6 * m.d)  # the MLP's temporaries
    if masked:
        b += (1 + e) * B * T * K  # the boolean (B, 1, T, K) mask and sdpa's float copy of it
    if scores:
        b += 3 * e * B * m.heads * T * K
    elif m.cuda_kernels:
        b += 4 * N * (m.d + m.heads)  # the backward's float32 gradient of q and softmax sums
    return b


def io_bytes(m: Dims, B: int, T: int) -> int:
    """The request's activations and the answer, each twice (bytes and tensor), float32 at most.
    On CUDA the bodies and the encoded answers are host memory: the device holds three
    (B, T, d) tensors in the compute dtype (the input, the gradient of the input, and the output
    or the gradient coming back: a U-shape backward holds all of them until it returns) and two
    answers' tensors in float32 at most (the output, the gradient of the input), kept until
    the step is applied."""
    if m.cuda:
        return (3 * m.elem + 2 * 4) * B * T * m.d
    return 4 * 4 * B * T * m.d


def kv_bytes(m: Dims, tokens: int, rows: int = 0, new: int = 1) -> int:
    """The KV cache of ``tokens`` cached positions (rows x length) in every block; with ``rows``
    given, a sliding layer's at most ``rows x (window - 1 + new)`` after a step of ``new``
    positions (else priced as full: an upper bound): a session's sliding layer keeps the step's
    concatenation (``window - 1`` past + ``new``; it records them so that the next step's crop can
    drop rejected drafts, :mod:`.sessions`) until the next step crops it back to ``window - 1``,
    the bytes transformers' own view of that concatenation keeps alive (a prefill: all of it)."""
    if m.kv_token:
        sliding = min(tokens, rows * (m.window - 1 + new)) if rows and m.window else tokens
        return tokens * (m.kv_token - m.kv_sliding) + sliding * m.kv_sliding
    return 2 * m.blocks * tokens * m.d * m.elem


# What an open generation session costs the host, per byte of :func:`kv_bytes`. Its cache's tensors
# are kv_bytes exactly (tests/test_server_memory_defaults.py), but they are allocated among the
# step's temporaries, and glibc keeps the heap pages around a long-lived tensor when those are
# freed: the RSS of 16 sessions held open on tiny-demo U (2, 4) grew 1.27x to 2.08x of kv_bytes
# (benchmarks/session_memory.py; docs/OPERATIONS.md, 'Memory defaults'). This covers that.
SESSION_SLACK = 2.25


def session_bytes(m: Dims, tokens: int, rows: int = 0, new: int = 1) -> int:
    """What a session whose cache holds ``tokens`` positions after a step of ``new`` (in ``rows``
    rows: a sliding layer's at most ``rows x (window - 1 + new)``, :func:`kv_bytes`) is reserved
    for (:mod:`.memory`): its KV cache times ``SESSION_SLACK`` (on CUDA the caching allocator's
    ``CUDA_SLACK``: its freed blocks serve the next tensors)."""
    return int(kv_bytes(m, tokens, rows, new) * (CUDA_SLACK if m.cuda else SESSION_SLACK))


def update_bytes(m: Dims) -> int:
    """A training step's gradients, and the optimizer's temporaries on top of them: torch's
    single-tensor AdamW (CPU tensors take no foreach path) makes two of each parameter's size in
    turn (``exp_avg_sq.sqrt()``, then divided), so twice the largest; its foreach path (CUDA)
    one of every parameter's size at once (``torch._foreach_sqrt``); 16-bit gradients are
    copied to float32 for the step's norm (:mod:`.guard`), all at once. On CUDA the norm's
    copies are freed before the optimizer steps (the caching allocator reuses their blocks):
    the larger of the two, not their sum."""
    norm_copies = m.grads * 4 // m.elem if m.elem < 4 else 0
    if m.cuda:
        return m.grads + max(m.grads, norm_copies)
    return m.grads + 2 * m.largest + norm_copies


def train_cost(m: Dims, B: int, T: int, padded: bool) -> int:
    """A training step's forward and backward and its update: ``/v1/train/step`` (a top, with
    the loss) or ``/v1/train/forward`` + its ``/v1/train/backward``, whose graph waits between."""
    e, N = m.elem, B * T
    kept = m.blocks * kept_per_block(m, B, T, T, padded)
    workspace = block_workspace(m, B, T, T, padded, m.scores)
    # the head's loss, its gradients made in the forward: the final norm's input (on CUDA: the last block's
    # output, counted in kept) and output, the shifted copy, grad of x; grad of W; one chunk
    head = 0
    if m.head:
        head = (3 if m.cuda else 4) * e * N * m.d + 4 * m.vocab * m.d + _chunk(m, N, grads=True)
    if m.cuda:  # phases: the head's forward, then the backward (from the head's grad of x), then the
        # update once the backward has freed the activations; each in the blocks the last freed
        backward = workspace + m.grads + (e * N * m.d if m.head else 0)
        return _slack(m, max(kept + max(head, backward), update_bytes(m)) + io_bytes(m, B, T))
    return _slack(m, kept + workspace + head + update_bytes(m) + io_bytes(m, B, T))


def graph_bytes(m: Dims, B: int, T: int, padded: bool, loss: bool = False) -> int:
    """What one training forward leaves waiting for its backward (:mod:`.memory` holds it):
    every block's kept tensors, its input and output and the answer sent (a tensor and its
    encoded bytes, float32 at most); ``loss``: a 2-way open-ended piece, whose chunked loss
    keeps the final norm's tensors and the gradients of x and W (:mod:`splitlearn.model.headloss`)."""
    e, N = m.elem, B * T
    b = m.blocks * kept_per_block(m, B, T, T, padded) + 2 * e * N * m.d + 2 * 4 * N * m.d
    if loss:
        b += 4 * e * N * m.d + m.vocab * m.d * e
    return _slack(m, b)


def _slack(m: Dims, tensor_bytes: int) -> int:
    return int(tensor_bytes * (CUDA_SLACK if m.cuda else ALLOCATOR_SLACK))


def _chunk(m: Dims, N: int, grads: bool) -> int:
    """One chunk of the head's loss (splitlearn/model/headloss.py): its logits, their float32 copy
    (16-bit compute), the log-softmax, and with ``grads`` the gradients of both."""
    c, e = min(m.chunk_rows, N), m.elem
    per = e + 4 + (4 if e < 4 else 0) + (8 + (e if e < 4 else 0) if grads else 0)
    return c * m.vocab * per


def forward_cost(m: Dims, B: int, T: int, padded: bool, labels: bool) -> int:
    """``/v1/forward`` without gradients: one block at a time, the last position's logits,
    and the loss in chunks when labels come."""
    e, N = m.elem, B * T
    b = e * N * m.d + block_workspace(m, B, T, T, padded, m.eager)  # no dropout in evaluation: flash sdpa
    if m.head:
        b += B * m.vocab * (e + 4)  # the last position's logits, and packed
        if labels:
            b += 2 * e * N * m.d + _chunk(m, N, grads=False)
    return _slack(m, b + io_bytes(m, B, T))


def session_step_cost(m: Dims, rows: int, past: int, T: int, padded: bool = True) -> int:
    """A generation step of T new positions after ``past``: the session's cache grown to
    past + T (one block's K and V copied as they grow), one block's workspace, last logits.
    ``padded``: the new positions' mask pads some."""
    K = past + T
    masked = padded or past > 0  # sdpa's causal flag serves only a first, unpadded prefill
    kv_copy = 2 * rows * K * (m.layer.kv if m.layer is not None else m.d) * m.elem  # one layer's K, V grown
    b = kv_bytes(m, rows * K, rows, T) + kv_copy + block_workspace(m, rows, T, K, masked, m.eager)
    if m.head:
        b += rows * m.vocab * (m.elem + 4)
    return _slack(m, b + io_bytes(m, rows, T))


# -- the limit -----------------------------------------------------------------------------

@dataclass
class Budget:
    """The most one request may cost, in bytes, and the model's dimensions to price requests."""

    limit: int  # bytes of working memory one request may take
    dims: Dims
    source: str = FLAG  # where the limit comes from: the flag, or how it was derived
    total: Optional[int] = None  # bytes: the memory account's default total (None: twice the limit)
    total_source: Optional[str] = None  # how ``total`` was derived

    def account_source(self) -> str:
        """Where the memory account's default total comes from (its refusals name it)."""
        return self.total_source or f"twice the per-request limit; {TOTAL_FLAG} sets it"

    def check(self, what: str, need: int, held: int = 0) -> None:
        """413 if ``need`` bytes exceed the limit; the message names the limit and the flag.
        Then ``need`` less ``held`` (what the route reserves on its own) is reserved for the
        request being served on this thread, until its answer is built
        (:func:`.memory.charge`; 503 past the server's total)."""
        if need > self.limit:
            raise PayloadTooLarge(
                f"{what} needs about {need / GiB:.2f} GiB of server memory; this server allows "
                f"{self.limit / GiB:.2f} GiB per request ({self.source}): send fewer rows or "
                f"positions (micro-batches, or a prompt in pieces)")
        charge(max(0, need - held), what)

    # one method per route, each (what, bytes) checked

    def train(self, B: int, T: int, mask: Optional[torch.Tensor]) -> None:
        """``/v1/train/step`` or ``/v1/train/forward`` (with its backward) of B x T positions."""
        self.check(f"a training step of {B} x {T} positions", train_cost(self.dims, B, T, padded(mask)))

    def train_forward(self, B: int, T: int, mask: Optional[torch.Tensor], loss: bool) -> None:
        """``/v1/train/forward`` of B x T positions (``loss``: 2-way, the server's loss): priced
        as the step, less the graph the route reserves on its own until the backward
        (:func:`graph_bytes`), so the account does not hold the kept activations twice."""
        m, pad = self.dims, padded(mask)
        self.check(f"a training step of {B} x {T} positions", train_cost(m, B, T, pad),
                   held=graph_bytes(m, B, T, pad, loss))

    def forward(self, B: int, T: int, mask: Optional[torch.Tensor], labels: bool) -> None:
        """``/v1/forward`` of B x T positions, with the loss if ``labels``."""
        self.check(f"a forward of {B} x {T} positions", forward_cost(self.dims, B, T, padded(mask), labels))

    def session(self, rows: int, tokens: int) -> None:
        """Opening a session of ``rows`` whose KV cache may grow to ``tokens`` positions."""
        self.check(f"a session of {rows} rows (its KV cache of up to {tokens} positions)",
                   kv_bytes(self.dims, tokens, rows))

    def session_step(self, rows: int, past: int, T: int, mask: Optional[torch.Tensor]) -> None:
        """A prefill or decode step of ``rows`` x T new positions after ``past`` cached ones."""
        self.check(f"a generation step of {rows} x {T} positions after {past}",
                   session_step_cost(self.dims, rows, past, T, padded(mask)))

    def to_dict(self) -> dict:
        return {"max_request_memory_bytes": self.limit, "max_request_memory_source": self.source}


def padded(mask: Optional[torch.Tensor]) -> bool:
    """Whether a (B, T) 0/1 mask pads any position (then sdpa gets a mask tensor, not a flag)."""
    return mask is not None and not bool(mask.all())


def trainable_bytes(module: nn.Module) -> int:
    """Bytes of the gradients a training step of ``module`` makes."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _read_int(path: str) -> Optional[int]:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _status_kib(field: str) -> Optional[int]:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes this process can still allocate, and which limit that is: the GPU's free memory
    on CUDA; on CPU the least of MemAvailable, the cgroup's limit less its usage, and the
    address-space limit (``RLIMIT_AS``) less the process's virtual size."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    found = []
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) << 10, "MemAvailable"))
    except OSError:
        pass
    if not found:
        found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"))
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 1 << 60:
            found.append((cap - used, "the cgroup's memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _status_kib("VmSize")
    if soft != resource.RLIM_INFINITY and size is not None:
        found.append((soft - size, "RLIMIT_AS"))
    return min(found)


def body_account(tenants: int, total: Optional[int] = None, per_tenant: Optional[int] = None) -> MemoryAccount:
    """The memory account of a server that holds request bodies only (the fed server, the
    offload server): ``total`` / ``per_tenant`` bytes as configured, else derived from the
    memory this process can still get (:func:`.memory.body_limits`)."""
    if total is not None:
        source = TOTAL_FLAG
    else:
        avail, what = available_memory(torch.device("cpu"))
        source = f"derived at start: {HOST_SHARE:g} of {what} ({avail / GiB:.2f} GiB); {TOTAL_FLAG} sets it"
        total = body_limits(avail, tenants)[0]
    total, per_tenant = body_limits(0, tenants, total, per_tenant)
    return MemoryAccount(total, per_tenant, source)


def derived_limit(available: int, state_bytes: int, halve: bool = True) -> int:
    """Half of what is left once the training state is allocated (``halve`` False, a GPU:
    all of it; the module docstring says why), at least ``MIN_DERIVED``."""
    return max(MIN_DERIVED, (available - state_bytes) // (2 if halve else 1))


def state_bytes(segment: nn.Module, optimizer: str, packed: bool) -> int:
    """What the segment's training state will still allocate: a gradient per trainable
    parameter and AdamW's two moments, and generation's prepacked copy of the weights
    (``--no-packed-weights``: none)."""
    weights = sum(p.numel() * p.element_size() for p in segment.parameters())
    return trainable_bytes(segment) * (3 if optimizer == "adamw" else 1) + (weights if packed else 0)


def make_budget(segment: nn.Module, dtype: torch.dtype, device: torch.device,
                limit_bytes: Optional[int], optimizer: str, packed: bool) -> Budget:
    """The server's budget: ``limit_bytes`` if configured, else derived (module docstring)."""
    device = torch.device(device)
    dims = Dims.of(segment, dtype, device)
    if limit_bytes is not None:
        return Budget(limit_bytes, dims, FLAG)
    avail, what = available_memory(device)
    state = state_bytes(segment, optimizer, packed and usable(segment))  # prepacked on the CPU only
    gpu = device.type == "cuda"
    limit = derived_limit(avail, state, halve=not gpu)
    source = (f"derived at start: {'all' if gpu else 'half'} of {what} ({avail / GiB:.2f} GiB) less the "
              f"training state ({state / GiB:.2f} GiB); {FLAG} sets it")
    if limit == MIN_DERIVED:
        log.warning("little memory left for requests (%s): each may use %.2f GiB", source, limit / GiB)
    log.info("each request may use %.2f GiB of memory (%s)", limit / GiB, source)
    if gpu:
        return Budget(limit, dims, source, total=limit, total_source=f"the per-request limit; {TOTAL_FLAG} sets it")
    # the host keeps (1 - HOST_SHARE) of what the training state leaves: the interpreter, the
    # allocator's slack beyond what is priced, other processes (docs/OPERATIONS.md, 'Memory defaults')
    total = max(limit, int(HOST_SHARE * (avail - state)))
    return Budget(limit, dims, source, total=total,
                  total_source=f"derived at start: {HOST_SHARE:g} of {what} ({avail / GiB:.2f} GiB) less the "
                               f"training state ({state / GiB:.2f} GiB); {TOTAL_FLAG} sets it")
