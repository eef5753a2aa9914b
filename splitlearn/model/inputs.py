"""Training and evaluation text as the client CLI reads it: a plain text file, JSON lines, or a
``datasets`` dataset, turned into one token stream.

=============  ==========================================================================
``text``       a UTF-8 file, the whole file one text (:func:`splitlearn.model.data.load_corpus`)
``jsonl``      one JSON object per line, its ``field`` (default ``"text"``) a document
``dataset``    a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a
               ``DatasetDict`` whose ``split`` is taken), its ``field`` column the documents
=============  ==========================================================================

``auto`` (the default) picks ``dataset`` for a directory, ``jsonl`` for a ``.jsonl``/``.json``
file, else ``text``. Documents are tokenized one by one and joined with the tokenizer's
end-of-text id; a plain text file is encoded whole, as before (the same batches for the same seed).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Union

from ..errors import ConfigError

FORMATS = ("auto", "text", "jsonl", "dataset")


def format_of(path: Union[str, Path], fmt: str = "auto") -> str:
    """The format ``path`` is read as (``fmt``, or what ``auto`` picks)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown data format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    p = Path(path)
    if p.is_dir():
        return "dataset"
    return "jsonl" if p.suffix in (".jsonl", ".json") else "text"


def read_documents(path: Union[str, Path], fmt: str = "auto", field: str = "text",
                   split: Optional[Sequence[str]] = None) -> list[str]:
    """The documents of ``path`` (a text file is one document). ``split``: the splits of a
    ``DatasetDict`` to try, in order (default: ``train``). ConfigError naming the file and the
    line, column or split when it is not what its format says."""
    kind = format_of(path, fmt)
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data file {p} does not exist")
    if kind == "text":
        return [p.read_text(encoding="utf-8")]
    if kind == "jsonl":
        docs = []
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{p}, line {i}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ConfigError(f"{p}, line {i}: no string field {field!r} (--text-field names it)")
            docs.append(row[field])
        return docs
    return _dataset_documents(p, field, tuple(split or ("train",)))


def _dataset_documents(p: Path, field: str, splits: tuple) -> list[str]:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError:
        raise ConfigError("reading a datasets dataset needs the datasets package: pip install 'splitlearn[train]'") \
            from None
    try:
        ds = load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{p} is not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, DatasetDict):
        name = next((s for s in splits if s in ds), None)
        if name is None:
            raise ConfigError(f"{p} has the splits {sorted(ds)}, none of {list(splits)}")
        ds = ds[name]
    if not isinstance(ds, Dataset) or field not in ds.column_names:
        raise ConfigError(f"{p} has no column {field!r} (its columns: {getattr(ds, 'column_names', None)}; "
                          f"--text-field names it)")
    return [t for t in ds[field] if isinstance(t, str)]


def token_stream(tokenizer, documents: Sequence[str], whole_text: bool = False) -> list[int]:
    """The documents' token ids, joined with the tokenizer's end-of-text id (``whole_text``: one
    text encoded as it is)."""
    if whole_text:
        return list(tokenizer.encode(documents[0]))
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for doc in documents:
        if doc.strip():
            ids.extend(tokenizer.encode(doc))
            if eos is not None:
                ids.append(int(eos))
    return ids


def read_tokens(tokenizer, path: Union[str, Path], fmt: str = "auto", field: str = "text",
                split: Optional[Sequence[str]] = None) -> list[int]:
    """:func:`read_documents` of ``path`` as one token stream (:func:`token_stream`)."""
    docs = read_documents(path, fmt, field, split)
    return token_stream(tokenizer, docs, whole_text=format_of(path, fmt) == "text")
