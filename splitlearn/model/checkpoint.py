"""Save and restore a side's training state: segment weights, optimizer state, counters.

A checkpoint is a *generation* directory, made visible all at once::

    DIR/NAME.latest                 "NAME-00000042": the generation to load (replaced atomically)
    DIR/NAME-00000042/
        weights.safetensors         segment parameters, Hugging Face names
        optim.safetensors           optimizer state tensors, keyed "<param index>.<key>"
        EXTRA.safetensors           optional named tensor sets (e.g. shared federation weights)
        state.json                  {"optimizer": {...param_groups, non-tensor state...},
                                     "counters": {...}, "segments": [...],
                                     "files": {file name: sha256 of its bytes}}
    DIR/NAME-00000041/              the previous generation, kept as a fallback

Written via ``NAME-<gen>.tmp/`` (fsynced, ``state.json`` last, renamed, pointer replaced);
files 0600 in 0700 directories (:func:`private_dir`, :func:`open_private`). Loading checks
every sha256 (:class:`~splitlearn.errors.SegmentFileError` naming the file); nothing is
unpickled. Crash behaviour: docs/RECOVERY.md, 'The server'."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import ConfigError, SegmentFileError
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
            # a copy: safetensors refuses tensors sharing storage (the tied wte / lm_head)
            out.setdefault(k, v.detach().cpu().contiguous().clone())
    return out


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state as safetensors-ready tensors keyed ``"<param index>.<key>"`` and a
    JSON-able rest ``{"param_groups", "scalars"}`` (the inverse is :func:`restore_optimizer`)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{idx}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = val
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], rest: dict) -> None:
    """Load what :func:`optimizer_state` gave back into ``optimizer``."""
    state: dict = {}
    for key, val in list(tensors.items()) + list(rest["scalars"].items()):
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = val
    optimizer.load_state_dict({"state": state, "param_groups": rest["param_groups"]})


def private_dir(path: Union[str, Path]) -> Path:
    """``path``, made if missing; each directory made here is 0700 (only its owner may enter it)."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in missing:  # mkdir's mode reaches only the last one, and through the umask
        os.chmod(p, 0o700)
    return path


def open_private(path: Union[str, Path]):
    """``path`` opened for writing (truncated), mode 0600 even if it existed with another."""
    f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
    os.fchmod(f.fileno(), 0o600)
    return f


def _write(path: Path, data: bytes) -> str:
    """Write (0600) and fsync ``data``; its sha256."""
    with open_private(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _generations(d: Path, name: str) -> list[Path]:
    return sorted(p for p in d.glob(f"{name}-*") if p.is_dir() and not p.name.endswith(".tmp"))


def save_state(directory: Union[str, Path], name: str, segments: Sequence[Segment],
               optimizer: torch.optim.Optimizer, counters: dict,
               extra: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> Path:
    """Write weights, optimizer state, ``counters`` (JSON-able) and ``extra`` tensor sets as a
    new generation under ``directory``; returns the generation's directory."""
    d = private_dir(directory)
    for stale in d.glob(f"{name}-*.tmp"):  # a save that a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    previous = _generations(d, name)
    gen = int(previous[-1].name.rsplit("-", 1)[1]) + 1 if previous else 1
    final = d / f"{name}-{gen:08d}"
    tmp = d / (final.name + ".tmp")
    tmp.mkdir(mode=0o700)
    os.chmod(tmp, 0o700)  # whatever the umask
    tensors, optim = optimizer_state(optimizer)
    files = {"weights.safetensors": _write(tmp / "weights.safetensors", st_save(_weights(segments))),
             "optim.safetensors": _write(tmp / "optim.safetensors", st_save(tensors))}
    for key, tset in (extra or {}).items():
        fname = f"{key}.safetensors"
        files[fname] = _write(tmp / fname, st_save({k: v.detach().cpu().contiguous() for k, v in tset.items()}))
    meta = {"optimizer": optim, "counters": counters, "segments": [[s.kind, s.start, s.end] for s in segments],
            "files": files}
    _write(tmp / "state.json", json.dumps(meta).encode())
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(d)
    pointer = d / f"{name}.latest.tmp"
    _write(pointer, final.name.encode())
    os.replace(pointer, d / f"{name}.latest")  # the moment the new generation counts
    _fsync_dir(d)
    for old in previous[:-1]:  # keep the one before as a fallback
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(directory: Union[str, Path], name: str) -> Optional[Path]:
    """The generation directory ``NAME.latest`` points to, or None if there is no checkpoint."""
    d = Path(directory)
    pointer = d / f"{name}.latest"
    if not pointer.is_file():
        return None
    gen = d / pointer.read_text().strip()
    if not gen.is_dir():
        raise SegmentFileError(f"checkpoint pointer {pointer} names {gen.name}, which does not exist: "
                               f"refusing to start from scratch; restore the directory or remove {pointer}")
    return gen


def has_state(directory: Union[str, Path], name: str) -> bool:
    return (Path(directory) / f"{name}.latest").is_file()


def _read_checked(gen: Path, fname: str, files: dict) -> bytes:
    path = gen / fname
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SegmentFileError(f"checkpoint file {path} cannot be read: {e}") from None
    if fname not in files or hashlib.sha256(data).hexdigest() != files[fname]:
        raise SegmentFileError(f"checkpoint file {path} is truncated or corrupt (its sha256 does not "
                               f"match {gen / 'state.json'}): refusing to load it; the previous "
                               f"generation, if any, is kept beside it")
    return data


def _tensors(gen: Path, fname: str, files: dict) -> dict[str, torch.Tensor]:
    data = _read_checked(gen, fname, files)
    try:
        return st_load(data)
    except (SafetensorError, ValueError) as e:
        raise SegmentFileError(f"checkpoint file {gen / fname} is not valid safetensors: {e}") from None


def read_meta(gen: Path) -> dict:
    path = gen / "state.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SegmentFileError(f"checkpoint file {path} is truncated or corrupt: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise SegmentFileError(f"checkpoint file {path} is not a splitlearn checkpoint state")
    return meta


def read_weights(directory: Union[str, Path], name: str) -> dict[str, torch.Tensor]:
    """The saved segment weights of the latest generation (Hugging Face names), checked."""
    gen = latest(directory, name)
    if gen is None:
        raise SegmentFileError(f"no {name} checkpoint in {directory}")
    return _tensors(gen, "weights.safetensors", read_meta(gen)["files"])


def read_extra(directory: Union[str, Path], name: str, key: str) -> Optional[dict[str, torch.Tensor]]:
    """An ``extra`` tensor set of the latest generation, or None if it was not saved."""
    gen = latest(directory, name)
    files = read_meta(gen)["files"] if gen is not None else {}
    return _tensors(gen, f"{key}.safetensors", files) if f"{key}.safetensors" in files else None


def load_state(directory: Union[str, Path], name: str, segments: Sequence[Segment],
               optimizer: torch.optim.Optimizer) -> dict:
    """Restore weights and optimizer state in place; return the saved counters."""
    d = Path(directory)
    gen = latest(d, name)
    if gen is None:
        raise SegmentFileError(f"no {name} checkpoint in {d}")
    meta = read_meta(gen)
    held = [[s.kind, s.start, s.end] for s in segments]
    if meta["segments"] != held:
        raise SegmentFileError(f"checkpoint in {gen} holds segments {meta['segments']}, "
                               f"this side holds {held}")
    weights = _tensors(gen, "weights.safetensors", meta["files"])
    tensors = _tensors(gen, "optim.safetensors", meta["files"])
    with torch.no_grad():
        for seg in segments:
            for (local, p), hf in zip(seg.state_dict(keep_vars=True).items(), seg.hf_state_dict()):
                if hf not in weights or weights[hf].shape != p.shape:
                    raise SegmentFileError(f"checkpoint in {gen} lacks {hf} of shape {list(p.shape)}")
                p.copy_(weights[hf])
    restore_optimizer(optimizer, tensors, meta["optimizer"])
    return meta["counters"]
