"""Hugging Face tokenizers for the specs without a hub checkpoint, built offline.

A spec in ``models/`` names its tokenizer in ``"tokenizer"``:

=================  ===================================================================
(absent)           UTF-8 bytes: byte b is token b, 256 is ``<|endoftext|>`` (vocab 257),
                   the ids of :class:`splitlearn.model.data.ByteTokenizer`
``tiny-stories``   a byte-level BPE of 1024 tokens trained on the shipped corpus
                   (``corpus/tiny-stories.tokenizer.json``; ``<|endoftext|>`` is 0)
``tiny-tales``     the same for the grammar's tales (``corpus/tiny_tales.txt``, made by
                   ``python -m splitlearn.model.corpus.generate``): 870 tokens, every word one
=================  ===================================================================

Both are ``transformers.PreTrainedTokenizerFast`` (GPT-2's byte alphabet, so any text encodes),
with ``<|endoftext|>`` as eos, bos and pad and left padding: ``pipeline("text-generation")``,
``Trainer`` with a data collator and lm-evaluation-harness take them as they take GPT-2's.
``python -m splitlearn.model.tokenizer`` trains the BPE again and rewrites the shipped file (the
trainer is deterministic: the same text gives the same file)."""
from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ..errors import ConfigError

EOS = "<|endoftext|>"
BYTES = "splitlearn/bytes"  # the byte tokenizer's name_or_path: how ``data.is_bytes`` knows it
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
TRAINED = {"tiny-stories": (CORPUS_DIR / "tiny_stories.txt", 1024),  # name -> (text it learns, vocab size)
           "tiny-tales": (CORPUS_DIR / "tiny_tales.txt", 870)}  # all the grammar's BPE holds: every word one token


def shipped_path(name: str) -> Path:
    return CORPUS_DIR / f"{name}.tokenizer.json"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """UTF-8 bytes as tokens (byte b -> id b, ``<|endoftext|>`` -> 256): a BPE with GPT-2's byte
    alphabet and no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))  # GPT-2's bytes_to_unicode: the other bytes map to chr(256 + k)
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    assert set(chars.values()) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab={**{chars[b]: b for b in range(256)}, EOS: 256}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return wrap(tok, BYTES)


def train_bpe(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens learnt from ``text`` (``<|endoftext|>`` is id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    return tok


def trained_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The shipped BPE ``name`` (a key of ``TRAINED``)."""
    path = shipped_path(name)
    if name not in TRAINED or not path.is_file():
        raise ConfigError(f"no tokenizer named {name!r}; splitlearn ships {', '.join(sorted(TRAINED))}")
    return wrap(Tokenizer.from_file(str(path)), f"splitlearn/{name}")


def wrap(tok: Tokenizer, name: str) -> PreTrainedTokenizerFast:
    """``tok`` as transformers' fast tokenizer: eos = bos = pad = ``<|endoftext|>``, left padding
    (no ``model_max_length``: pipelines and lm-eval read the model's ``max_position_embeddings``)."""
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   padding_side="left", name_or_path=name)


def model_vocab_size(source: str):
    """The vocabulary size the checkpoint ``source`` (a directory or a hub id) declares in its
    config (``vocab_size``, or its ``text_config``'s); None where it cannot be read."""
    import json

    p = Path(source) / "config.json"
    try:
        if p.is_file():
            d = json.loads(p.read_text())
        else:
            from transformers import AutoConfig

            d = AutoConfig.from_pretrained(source).to_dict()
    except Exception:  # no config to read (no hub, no cache): the model's own load says why
        return None
    vocab = d.get("vocab_size", (d.get("text_config") or {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def fit_model(tok, source: str):
    """``tok`` if it fits the checkpoint ``source``'s vocabulary, else ConfigError: a tokenizer with
    more ids than the model has embeddings, or splitlearn's byte tokenizer (the fallback where a
    checkpoint has no tokenizer files) for a model whose vocabulary is not the bytes' 257."""
    vocab = model_vocab_size(source)
    if vocab is None:
        return tok
    n = len(tok)
    if getattr(tok, "name_or_path", None) == BYTES and vocab != n:
        raise ConfigError(f"{source} has no tokenizer files (tokenizer.json, vocab.json + merges.txt, ...) and "
                          f"its vocabulary is {vocab} tokens: splitlearn's byte tokenizer ({n} ids) is not its "
                          f"tokenizer. Save the model's tokenizer beside it (tokenizer.save_pretrained(dir)) or "
                          f"load the tokenizer from where the model came from")
    if n > vocab:
        raise ConfigError(f"the tokenizer of {source} has {n} tokens, the model's vocabulary {vocab}: ids from "
                          f"{vocab} on have no embedding. Use the tokenizer the model was trained with")
    return tok


def main(argv=None) -> int:
    """Train every tokenizer of ``TRAINED`` again and write it where splitlearn ships it."""
    for name, (text, vocab_size) in TRAINED.items():
        path = shipped_path(name)
        path.write_text(train_bpe(text.read_text(encoding="utf-8"), vocab_size).to_str(pretty=True) + "\n")
        print(f"wrote {path} ({vocab_size} tokens, {path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
