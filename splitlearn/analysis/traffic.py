"""Bytes that cross each cut, bytes each side keeps (KV cache), and weights both sides hold.

A cut carries (B, S, d) forward and, in training, its gradient back. Tensor bytes per wire
dtype: float32 4, bfloat16/float16 2, int8 1 per element + one float32 scale per row of d
(n + 4·B·S). KV cache: per layer 2 · B · T · num_key_value_heads · head_dim elements (a sliding
layer holds at most its window), the adapter's :meth:`~splitlearn.model.arch.Arch.kv_bytes`;
GPT-2: 2 · blocks · B · T · d. See docs/ANALYSIS.md."""
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
    d = part.config.hidden_size
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
    """Bytes of ``seg``'s KV cache after ``length`` tokens (0 for a segment with no layers)."""
    if not len(seg.layers_list):
        return 0
    elem = next(seg.layers_list.parameters()).element_size()
    return batch * seg.arch.kv_bytes(length, elem, seg.start, seg.end)


def tied_parameters(part: Partition) -> list[dict]:
    """Tensors held by more than one segment (a tied embedding and head: GPT-2's, Gemma's)."""
    owners: dict[int, list[tuple[str, str, int]]] = {}
    for seg in part.segments:
        for name, p in seg.named_parameters():
            key = id(p) if p.is_meta else p.data_ptr()  # meta tensors have no storage to compare
            owners.setdefault(key, []).append((seg.kind, name, p.numel()))
    tied = []
    for holders in owners.values():
        if len(holders) > 1:
            tied.append({"holders": [{"segment": s, "parameter": n} for s, n, _ in holders],
                         "params": holders[0][2],
                         "note": "one tensor held by several segments; each segment that "
                                 "holds a copy counts it in its params"})
    return tied
