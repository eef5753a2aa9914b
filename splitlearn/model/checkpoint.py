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
files 0600 in 0700 directories (:func:`private_dir`, :func:`open_private`: new files only,
``O_EXCL | O_NOFOLLOW``). A directory another user owns or may write is refused
(:func:`check_private_dir`); loading reads only this user's own regular files, never through a
link (:func:`read_own`), and checks every sha256 against ``state.json``
(:class:`~splitlearn.errors.SegmentFileError` naming the file); nothing is unpickled. Crash
behaviour: docs/RECOVERY.md, 'The server'; the attacks: docs/SECURITY.md, 'Files and sockets
are the server's own'."""
from __future__ import annotations

import hashlib
import json
import os
import logging
import shutil
import stat
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import ConfigError, SegmentFileError
from .segments import Segment

log = logging.getLogger(__name__)


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
            # a copy: safetensors refuses tensors sharing storage (a tied embedding / lm_head)
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


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def not_own(st: os.stat_result, directory: bool) -> Optional[str]:
    """Why ``st`` (an ``lstat``) is not this process's own private file or directory, or None:
    a link, another kind, another owner, or writable by group or others."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by {_owner(st.st_uid)}, not by this process's {_owner(os.geteuid())}"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_parents(path: Union[str, Path]) -> None:
    """Every existing directory above ``path`` is this user's or root's, and writable by no one
    else unless sticky (``/tmp``): else a stranger could rename ``path`` away and put their own
    in its place."""
    path = Path(path)
    for p in path.absolute().parents:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, os.geteuid()):
            raise ConfigError(f"{path}: the directory {p} above it is owned by {_owner(st.st_uid)}, who could "
                              f"replace what this server keeps there; use a directory of your own")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"{path}: the directory {p} above it is writable by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}, not sticky); use a directory of your own")


def check_private_dir(path: Union[str, Path]) -> Path:
    """Refuse (:class:`~splitlearn.errors.ConfigError`, with what was found and what to do) an
    existing ``path`` that is not this user's own directory writable by no one else; a link of
    this user's own is followed to its target, checked the same. Group/other read bits of an own
    directory are removed (0700). docs/SECURITY.md, 'Files and sockets are the server's own'."""
    path = Path(path)
    check_parents(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
        real = Path(os.path.realpath(path))
        check_parents(real)
        st, shown = os.lstat(real), f"{path} (a link to {real})"
    else:
        real, shown = path, str(path)
    reason = not_own(st, directory=True)
    if reason is not None:
        raise ConfigError(f"{shown} {reason}: refusing it (another local user may have made it, planted "
                          f"files or links in it, or may read what is written there); remove it, or "
                          f"give a directory of this user's own (made 0700 when missing)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("%s was mode %04o: made 0700 (only its owner may enter it)", shown, stat.S_IMODE(st.st_mode))
        os.chmod(real, 0o700)
    return path


def private_dir(path: Union[str, Path]) -> Path:
    """``path``, made if missing, each directory made here 0700; an existing one must be this
    user's own and writable by no one else (:func:`check_private_dir`, else ConfigError)."""
    path = Path(path)
    if os.path.lexists(path):
        return check_private_dir(path)  # (the journal calls this per record: one pass)
    check_parents(path)
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # made meanwhile by someone: checked below like any existing one
            continue
        os.chmod(p, 0o700)  # mkdir's mode goes through the umask
    return check_private_dir(path)


_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_private(path: Union[str, Path]):
    """A new file ``path`` (0600) opened for writing, in a directory of :func:`private_dir`'s: a
    stale one of ours is removed first; never through a link (``O_EXCL | O_NOFOLLOW``)."""
    try:
        os.unlink(path)  # unlink never follows a link: a planted one goes, its target stays
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, _NEW, 0o600), "wb")


def write_private(path: Union[str, Path], data: bytes) -> Path:
    """``data`` to ``path`` (0600) atomically: a new file of an unguessable name in the same
    directory (O_EXCL), fsynced, renamed over ``path`` (a rename replaces a link, never follows
    it). An existing ``path`` must be this user's own regular file, else ConfigError."""
    import tempfile

    path = Path(path)
    try:
        reason = not_own(os.lstat(path), directory=False)
    except FileNotFoundError:
        reason = None
    if reason is not None:
        raise ConfigError(f"{path} {reason}: refusing to write over it (another local user may read it "
                          f"or have linked it elsewhere); remove it or choose another path")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def append_private(path: Union[str, Path]):
    """``path`` opened for appending text (a log), created 0600; an existing one must be this
    user's own regular file (its mode made 0600), never a link: else ConfigError."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        raise ConfigError(f"{path}: cannot open it for appending (a link is never followed): {e}") from None
    st = os.fstat(fd)
    reason = "is not a regular file" if not stat.S_ISREG(st.st_mode) else (
        None if st.st_uid == os.geteuid() else f"is owned by {_owner(st.st_uid)}, not by this process's "
                                                 f"{_owner(os.geteuid())}")
    if reason is not None:
        os.close(fd)
        raise ConfigError(f"{path} {reason}: refusing to write to it (another local user would read it); "
                          f"remove it or choose another path")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8")


def read_own(path: Union[str, Path]) -> bytes:
    """The bytes of ``path``, a file this user wrote: opened without following a link, refused
    (:class:`~splitlearn.errors.SegmentFileError`) if another user owns it or may write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SegmentFileError(f"checkpoint file {path} cannot be read (a link is never followed): {e}") from None
    with os.fdopen(fd, "rb") as f:
        reason = not_own(os.fstat(fd), directory=False)
        if reason is not None:
            raise SegmentFileError(f"checkpoint file {path} {reason}: this server did not write it; refusing "
                                   f"to load it (remove it, or restore the directory from a copy you trust)")
        return f.read()


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
    """The generation directory ``NAME.latest`` points to, or None if there is no checkpoint;
    the pointer and the generation must be this user's own (:func:`read_own`, :func:`not_own`)."""
    d = Path(directory)
    pointer = d / f"{name}.latest"
    if not os.path.lexists(pointer):
        return None
    gen = d / read_own(pointer).decode("utf-8", "replace").strip()
    if gen.parent != d or not os.path.lexists(gen):
        raise SegmentFileError(f"checkpoint pointer {pointer} names {gen.name}, which does not exist: "
                               f"refusing to start from scratch; restore the directory or remove {pointer}")
    reason = not_own(os.lstat(gen), directory=True)
    if reason is not None:
        raise SegmentFileError(f"checkpoint generation {gen} {reason}: this server did not write it; "
                               f"refusing to load it")
    return gen


def has_state(directory: Union[str, Path], name: str) -> bool:
    """Whether ``directory`` holds a checkpoint ``name``; an existing ``directory`` must be this
    user's own (:func:`check_private_dir`: a server refuses at start one a stranger made)."""
    if not os.path.lexists(directory):
        return False
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        return False  # a file there: nothing to resume, nothing written through it (/v1/ready: 503)
    check_private_dir(directory)
    return os.path.lexists(Path(directory) / f"{name}.latest")


def _read_checked(gen: Path, fname: str, files: dict) -> bytes:
    path = gen / fname
    data = read_own(path)
    if fname not in files or hashlib.sha256(data).hexdigest() != files[fname]:
        raise SegmentFileError(f"checkpoint file {path} is truncated, corrupt or not this server's (its "
                               f"sha256 does not match {gen / 'state.json'}): refusing to load it; the "
                               f"previous generation, if any, is kept beside it")
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
        meta = json.loads(read_own(path))
    except ValueError as e:
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
