"""Export segments to disk and load one without the others' weights.

``export_segments(model, cuts, out_dir)`` writes, per segment::

    out_dir/bottom.safetensors   the segment's tensors, Hugging Face names
    out_dir/bottom.json          its spec (below)
    out_dir/trunk.* / top.*

The spec::

    {"format": "splitlearn-segment", "version": 1,
     "kind": "top", "blocks": [4, 12], "cuts": [2, 4],
     "config": {...the model's config, model_type included...}, "dtype": "float32",
     "tensors": {"model.layers.4.input_layernorm.weight": {"shape": [768], "dtype": "float32"}, ...},
     "sha256": "<hex digest of the .safetensors file>",
     "tied_lm_head": "copy"}

Any family the adapter knows (docs/MODELS.md). An exported top holds its own copy of a tied
embedding/head weight;
:func:`load_segments` re-ties bottom and top. Loading checks the hash, the tensor names and
every shape first; a mismatch raises :class:`SegmentFileError`."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .devices import dtype_name, resolve_device, resolve_dtype
from ..errors import SegmentFileError
from .loading import config_from_dict
from .partition import Partition, partition
from .segments import KINDS, Segment

FORMAT, VERSION = "splitlearn-segment", 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def export_segments(model: Union[nn.Module, Partition], cuts: Optional[Sequence[int]] = None,
                    out_dir: Union[str, Path] = ".") -> list[Path]:
    """Write each segment of ``partition(model, cuts)`` to ``out_dir``; return the spec paths."""
    parts = model if isinstance(model, Partition) else partition(model, cuts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for seg in parts:
        tensors = {k: v.detach().contiguous().clone() for k, v in seg.hf_state_dict().items()}
        weights = out / f"{seg.kind}.safetensors"
        save_file(tensors, str(weights), metadata={"format": FORMAT, "kind": seg.kind})
        spec = {
            "format": FORMAT, "version": VERSION, "kind": seg.kind, "blocks": [seg.start, seg.end],
            "cuts": list(parts.cuts), "config": parts.config.to_dict(),
            "dtype": dtype_name(next(seg.parameters()).dtype) if len(tensors) else "float32",
            "tensors": {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in tensors.items()},
            "sha256": _sha256(weights),
            "tied_lm_head": "copy" if seg.has_head else None,
        }
        spec_path = out / f"{seg.kind}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        written.append(spec_path)
    return written


def read_segment_spec(path: Union[str, Path]) -> tuple[dict, Path]:
    """The spec of a segment and the path of its weights; ``path`` is either file or the stem."""
    p = Path(path)
    spec_path = p.with_suffix(".json") if p.suffix in (".safetensors", "") else p
    if not spec_path.is_file():
        raise SegmentFileError(f"no segment spec at {spec_path}")
    try:
        spec = json.loads(spec_path.read_text())
    except json.JSONDecodeError as e:
        raise SegmentFileError(f"{spec_path} is not valid JSON: {e}") from None
    if not isinstance(spec, dict) or spec.get("format") != FORMAT or spec.get("version") != VERSION:
        raise SegmentFileError(f"{spec_path} is not a {FORMAT} v{VERSION} spec")
    missing = [k for k in ("kind", "blocks", "cuts", "config", "tensors", "sha256") if k not in spec]
    if missing:
        raise SegmentFileError(f"{spec_path} lacks the fields {missing}")
    if spec["kind"] not in KINDS:
        raise SegmentFileError(f"{spec_path}: unknown segment kind {spec['kind']!r}")
    return spec, spec_path.with_suffix(".safetensors")


def load_segment(path: Union[str, Path], *, device: Union[str, torch.device, None] = None,
                 dtype: Union[str, torch.dtype, None] = None) -> Segment:
    """Load one exported segment (``out_dir/top.json`` or ``out_dir/top``), nothing else, checked
    first; returns the :class:`Segment` in eval mode on ``device`` (default cpu), in ``dtype``."""
    spec, weights = read_segment_spec(path)
    if not weights.is_file():
        raise SegmentFileError(f"segment weights {weights} are missing")
    digest = _sha256(weights)
    if digest != spec["sha256"]:
        raise SegmentFileError(f"{weights} does not match its spec: sha256 {digest[:12]}... "
                               f"!= {spec['sha256'][:12]}... (corrupted or replaced file)")
    config = config_from_dict(spec["config"])
    start, end = spec["blocks"]
    with torch.device("meta"):
        seg = Segment(config, spec["kind"], start, end)
    _buffers_off_meta(seg)
    expected = {k: list(v.shape) for k, v in seg.hf_state_dict().items()}
    tensors = load_file(str(weights))
    _check_tensors(weights, spec, expected, tensors)
    local = {k: tensors[hf] for k, hf in zip(seg.state_dict().keys(), seg.hf_state_dict().keys())}
    seg.load_state_dict(local, strict=True, assign=True)
    torch_dtype = resolve_dtype(dtype)
    seg = seg.to(device=resolve_device(device or "cpu"), dtype=torch_dtype) if torch_dtype else \
        seg.to(resolve_device(device or "cpu"))
    return seg.eval()


def _buffers_off_meta(seg: Segment) -> None:
    """Non-persistent buffers (rotary frequencies, Gemma's embedding scale) are in no file: a
    segment built on meta computes them as the family's own initialisation does, before its
    parameters are assigned (so that initialisation touches no loaded weight)."""
    owners = [m for m in seg.modules() if any(b.is_meta for b in m.buffers(recurse=False))]
    if not owners:
        return
    with torch.device("meta"):
        origin = seg.arch.new_model(seg.config)  # for its _init_weights
    for m in owners:
        for name, b in list(m.named_buffers(recurse=False)):
            if b.is_meta:
                m._buffers[name] = torch.empty_like(b, device="cpu")
        origin._init_weights(m)


def _check_tensors(weights: Path, spec: dict, expected: dict, tensors: dict) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise SegmentFileError(f"{weights}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        declared = spec["tensors"].get(name, {}).get("shape")
        if list(tensors[name].shape) != shape or declared != shape:
            raise SegmentFileError(f"{weights}: tensor {name} has shape {list(tensors[name].shape)} "
                                   f"(spec says {declared}), the config needs {shape}")


def load_segments(out_dir: Union[str, Path], kinds: Iterable[str], **kw) -> list[Segment]:
    """Load several segments of one export; a bottom and top loaded together are re-tied."""
    segs = [load_segment(Path(out_dir) / k, **kw) for k in kinds]
    by_kind = {s.kind: s for s in segs}
    if "bottom" in by_kind and "top" in by_kind and by_kind["top"].config.tie_word_embeddings:
        bottom = by_kind["bottom"]
        by_kind["top"].head_module.weight = getattr(bottom, bottom.arch.embed_names[0]).weight
    return segs
