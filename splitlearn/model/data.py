"""Offline data: the specs' tokenizers (:func:`get_tokenizer`; a hand-written byte tokenizer, ids
0..255 and 256 = end-of-text, for the vocab-257 specs), the shipped corpus, and language-model
batches."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch

from ..errors import ConfigError

CORPUS = Path(__file__).resolve().parent / "corpus" / "tiny_stories.txt"


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255); ``eos_token_id`` = 256. Vocabulary size 257."""

    vocab_size = 257
    eos_token_id = 256
    pad_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __call__(self, texts: Union[str, list[str]]) -> dict:
        """Left-padded batch, like a Hugging Face tokenizer with ``padding_side="left"``."""
        texts = [texts] if isinstance(texts, str) else texts
        return left_pad([self.encode(t) for t in texts], self.pad_token_id)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> dict:
    """Batch sequences with left padding: ``{"input_ids": (B, T) long, "attention_mask": (B, T) long}``."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, T - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[i, T - len(s):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def get_tokenizer(source: Optional[str] = None):
    """A ``transformers.PreTrainedTokenizerFast`` for ``source``, offline for every spec: the
    spec's own (``models/NAME.json``'s ``"tokenizer"``, :mod:`splitlearn.model.tokenizer`), else UTF-8
    bytes (ids of :class:`ByteTokenizer`) for spec names, ``random:`` sources, JSON configs and
    checkpoints without tokenizer files whose vocabulary is the bytes'; the tokenizer of a local
    directory or hub id that has one. A tokenizer that does not fit the checkpoint's vocabulary (the
    bytes for a 50,257-token GPT-2 without tokenizer files) is a ConfigError
    (:func:`splitlearn.model.tokenizer.fit_model`). Left padding, and a pad token (the eos where the
    tokenizer has none)."""
    from .loading import is_spec_source, read_spec
    from .tokenizer import byte_tokenizer, fit_model, trained_tokenizer

    if source is None or not isinstance(source, (str, Path)):
        return byte_tokenizer()
    s = str(source)
    local = Path(s).is_dir()
    if is_spec_source(s):
        spec = json.loads(Path(s).read_text()) if Path(s).is_file() else read_spec(s.removeprefix("random:"))
        return trained_tokenizer(spec["tokenizer"]) if spec.get("tokenizer") else byte_tokenizer()
    if Path(s).exists() and not local:  # a file that is no config (a segment's weights, ...): bytes
        return byte_tokenizer()
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(s, local_files_only=local)
    except Exception:  # a checkpoint without tokenizer files, or no hub: bytes, if they fit its vocabulary
        return fit_model(byte_tokenizer(), s)
    if not tok.vocab_size or len(tok) <= len(set(tok.all_special_ids)):
        # where the files are missing transformers 5 builds the family's tokenizer empty: GPT-2's with
        # no token, Gemma's, Qwen2's, GPT-NeoX's with only their special tokens (any text: one <unk>)
        return fit_model(byte_tokenizer(), s)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return fit_model(tok, s)  # a tokenizer of more ids than the model's vocabulary: ConfigError


def is_bytes(tokenizer) -> bool:
    """Whether ``tokenizer`` encodes text as its UTF-8 bytes (:class:`ByteTokenizer`, or the
    Hugging Face byte tokenizer :func:`get_tokenizer` gives the byte specs)."""
    from .tokenizer import BYTES

    return isinstance(tokenizer, ByteTokenizer) or getattr(tokenizer, "name_or_path", None) == BYTES


def load_corpus(path: Optional[Union[str, Path]] = None) -> str:
    """The text of ``path``, or of the corpus shipped with splitlearn."""
    return Path(path or CORPUS).read_text(encoding="utf-8")


def lm_batches(ids: Sequence[int], batch_size: int, seq_len: int, *, seed: int = 0,
               steps: Optional[int] = None) -> Iterator[torch.Tensor]:
    """Random (batch_size, seq_len) long windows of one token stream, reproducible for a seed;
    forever unless ``steps`` is given."""
    data = torch.tensor(list(ids), dtype=torch.long)
    if len(data) <= seq_len:
        raise ConfigError(f"the corpus has {len(data)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed)
    n = 0
    while steps is None or n < steps:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])  # (B, T)
        n += 1
