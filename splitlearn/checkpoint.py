"""Save and restore a side's training state: segment weights, optimizer state, counters.

A checkpoint directory holds, per side (``name`` = ``server`` or ``client``)::

    NAME.weights.safetensors   segment parameters, Hugging Face names
    NAME.optim.safetensors     optimizer state tensors, keyed "<param index>.<key>"
    NAME.json                  {"optimizer": {...param_groups, non-tensor state...},
                                "counters": {...}, "segments": [...]}

Files are written to a temporary name and renamed, so a crash mid-save leaves the last
good checkpoint. Nothing is unpickled on load: tensors come from safetensors, the rest JSON.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence, Union

import torch
from safetensors.torch import load_file, save_file

from .errors import ConfigError, SegmentFileError
from .segments import Segment


def make_optimizer(params, name: str, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``adamw`` or ``sgd`` over ``params`` (the same rule on client and server)."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError(f"unknown optimizer {name!r}; choose adamw or sgd")


def unique_parameters(segments: Sequence[Segment]) -> list[torch.nn.Parameter]:
    """Parameters of the segments in order, each once (a tied weight counts once)."""
    seen, out = set(), []
    for seg in segments:
        for p in seg.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _weights(segments: Sequence[Segment]) -> dict[str, torch.Tensor]:
    out = {}
    for seg in segments:
        for k, v in seg.hf_state_dict().items():
            out.setdefault(k, v.detach().cpu().contiguous().clone())
    return out


def _atomic_save(tensors: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def save_state(directory: Union[str, Path], name: str, segments: Sequence[Segment],
               optimizer: torch.optim.Optimizer, counters: dict) -> Path:
    """Write weights, optimizer state and ``counters`` (JSON-able) under ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{idx}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = val
    _atomic_save(_weights(segments), d / f"{name}.weights.safetensors")
    _atomic_save(tensors, d / f"{name}.optim.safetensors")
    meta = {"optimizer": {"param_groups": sd["param_groups"], "scalars": scalars},
            "counters": counters, "segments": [[s.kind, s.start, s.end] for s in segments]}
    tmp = d / f"{name}.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, d / f"{name}.json")  # written last: its presence marks a complete checkpoint
    return d


def has_state(directory: Union[str, Path], name: str) -> bool:
    return (Path(directory) / f"{name}.json").is_file()


def load_state(directory: Union[str, Path], name: str, segments: Sequence[Segment],
               optimizer: torch.optim.Optimizer) -> dict:
    """Restore weights and optimizer state in place; return the saved counters."""
    d = Path(directory)
    meta = json.loads((d / f"{name}.json").read_text())
    held = [[s.kind, s.start, s.end] for s in segments]
    if meta["segments"] != held:
        raise SegmentFileError(f"checkpoint in {d} holds segments {meta['segments']}, "
                               f"this side holds {held}")
    weights = load_file(str(d / f"{name}.weights.safetensors"))
    with torch.no_grad():
        for seg in segments:
            for (local, p), hf in zip(seg.state_dict(keep_vars=True).items(), seg.hf_state_dict()):
                if hf not in weights or weights[hf].shape != p.shape:
                    raise SegmentFileError(f"checkpoint in {d} lacks {hf} of shape {list(p.shape)}")
                p.copy_(weights[hf])
    tensors = load_file(str(d / f"{name}.optim.safetensors"))
    state: dict = {}
    for key, val in list(tensors.items()) + list(meta["optimizer"]["scalars"].items()):
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = val
    optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})
    return meta["counters"]
