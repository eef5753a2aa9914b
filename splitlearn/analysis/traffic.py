"""Bytes that cross each cut, bytes each side keeps (KV cache), and weights both sides hold.

A cut carries (B, S, d) forward and, in training, its gradient back. Tensor bytes per wire
dtype: float32 4, bfloat16/float16 2, int8 1 per element + one float32 scale per row of d
(n + 4·B·S). KV cache: 2 · blocks · B · T · d elements. See docs/ANALYSIS.md."""
from __future__ import annotations

from ..model.partition import Partition
from ..model.segments import Segment
from ..api.wire import WIRE_DTYPE_NAMES, tensor_bytes


def wire_bytes(batch: int, tokens: int, width: int) -> dict[str, int]:
    """Bytes of one (batch, tokens, width) tensor per wire dtype."""
    return {name: tensor_bytes(name, batch * tokens * width, batch * tokens)
            for name in WIRE_DTYPE_NAMES}


def cut_traffic(part: Partition, batch: int, tokens: int, mode: str) -> list[dict]:
    """One entry per cut: where it is, and the bytes crossing it per direction and wire dtype
    (``tokens``: new tokens per step; gradients only in train mode)."""
    d = part.config.n_embd
    out = []
    for i, c in enumerate(part.cuts):
        src, dst = part.segments[i], part.segments[i + 1]
        entry = {"block": c, "from": src.kind, "to": dst.kind, "shape": [batch, tokens, d],
                 "activations_bytes": wire_bytes(batch, tokens, d)}
        if mode == "train":
            entry["gradients_bytes"] = wire_bytes(batch, tokens, d)
        out.append(entry)
    return out


def kv_cache_bytes(seg: Segment, batch: int, length: int) -> int:
    """Bytes of ``seg``'s KV cache after ``length`` tokens (0 for a segment with no blocks)."""
    if not len(seg.h):
        return 0
    elem = seg.h[0].attn.c_attn.weight.element_size()
    return 2 * len(seg.h) * batch * length * seg.config.n_embd * elem


def tied_parameters(part: Partition) -> list[dict]:
    """Tensors held by more than one segment (GPT-2: lm_head.weight is wte.weight)."""
    owners: dict[int, list[tuple[str, str, int]]] = {}
    for seg in part.segments:
        for name, p in seg.named_parameters():
            owners.setdefault(p.data_ptr(), []).append((seg.kind, name, p.numel()))
    tied = []
    for holders in owners.values():
        if len(holders) > 1:
            tied.append({"holders": [{"segment": s, "parameter": n} for s, n, _ in holders],
                         "params": holders[0][2],
                         "note": "one tensor held by several segments; each segment that "
                                 "holds a copy counts it in its params"})
    return tied
