"""A digest of tensors computed where they lie: on a GPU, without copying them to host memory.

    sums = fingerprint(t)                    # int64 (3,), on t's device: no copy, no wait
    d = digest({"hidden": h}, {"step": "1"}) # BLAKE2b-128 of names, dtypes, shapes, metadata, sums

Three int64 sums over a tensor's bytes read as 64-bit words ``w_i`` (zero-padded), with odd
weights ``o_i = 2i + 1`` and wrapping arithmetic::

    s1 = sum w_i        s2 = sum w_i * o_i        s3 = sum (w_i ^ (w_i >> 29)) * M * o_i

(``M`` the golden ratio's odd 64-bit constant). Integer sums modulo 2**64 do not depend on the
order they are added in, so the sums are the same on any device and any reduction kernel: a
digest made on a GPU equals the one made of the same bytes on the CPU. Any one changed word
changes ``s1``; two changed words, or a word moved, change ``s2`` (but for differences that are
multiples of a large power of two, which ``s3``'s mixed bits then tell apart).
What it names: an answer kept for exactly-once bookkeeping (the server's ledger, the client's
request log), to tell the same answer from another after a crash. It is no defence against an
adversary choosing bytes to collide (nothing here relies on that: docs/SECURITY.md, "Stored
answers are digests or bounded bytes").

Why not BLAKE2b of the bytes: on a GPU that copies each tensor to host memory and hashes it on
one core (19 ms for 12.6 MB on the CPU host, plus the copy and its wait), twice per training step
of GPT-2 small at 8 x 1024 on each side (issue 42, docs/PERFORMANCE.md 'On a GPU'); the sums
cost microseconds there and one read-back of 24 bytes a tensor.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit multiplier, as a signed int64
CHUNK_WORDS = 1 << 22  # words summed at once: temporaries of at most ~4 x 32 MiB beside the tensor


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The three int64 sums of ``t``'s bytes, on ``t``'s device (see the module docstring)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -b.numel() % 8
    if pad or b.storage_offset() % 8:  # whole int64 words, aligned: a copy padded with zeros
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int64)  # (n,)
    sums = torch.zeros(3, dtype=torch.int64, device=w.device)
    for start in range(0, w.numel(), CHUNK_WORDS):  # temporaries of a chunk at a time (the sums commute)
        c = w[start:start + CHUNK_WORDS]
        odd = torch.arange(2 * start + 1, 2 * (start + c.numel()), 2, device=w.device, dtype=torch.int64)
        sums += torch.stack([c.sum(), (c * odd).sum(), ((c ^ (c >> 29)) * _MIX * odd).sum()])
    return sums


def digests(items: list[tuple[dict[str, torch.Tensor], Optional[dict]]]) -> list[bytes]:
    """BLAKE2b-128 of each ``(tensors, metadata)``: the tensors' names, dtypes and shapes, the
    metadata and each tensor's :func:`fingerprint`; all the sums read back in one copy."""
    named = [sorted(tensors.items()) for tensors, _ in items]
    flat = [t for ts in named for _, t in ts]
    dev = next((t.device for t in flat if t.is_cuda), torch.device("cpu"))
    sums = torch.stack([fingerprint(t).to(dev) for t in flat]).cpu().numpy() if flat else None
    out, k = [], 0
    for ts, (_, meta) in zip(named, items):
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps([[n, str(t.dtype), list(t.shape)] for n, t in ts]).encode())
        h.update(json.dumps(meta or {}, sort_keys=True).encode())
        h.update(sums[k:k + len(ts)].tobytes() if ts else b"")
        k += len(ts)
        out.append(h.digest())
    return out


def digest(tensors: dict[str, torch.Tensor], meta: Optional[dict] = None) -> bytes:
    """:func:`digests` of one."""
    return digests([(tensors, meta)])[0]


# -- the model a session starts from (issue 51, item 4) -----------------------------------------
#
# Client and server compare, at session start, the checkpoint each loaded: its config, field by
# field, and its weights *at load* (before any training or checkpoint restored), part by part. The
# server publishes a digest of each part it holds (``/v1/info`` "fingerprint"); the client makes
# the same digests of its own copy of those parts, which it holds when it loads the whole model.
# A part is a layer (``model.layers.3``: the names up to the first number) or a module outside the
# layers (``model.embed_tokens``, ``lm_head``). Digests are made in the server's
# compute dtype (a float32 client copy cast as the server cast its own at load: bit-equal).

#: config fields that do not change what the weights compute: names, runtime switches, heads'
#: labels, token ids of the tokenizer, initialisation, dropout (each side trains with its own),
#: tying (a 2-way server keeps its own copy of the head), splitlearn's own keys
IGNORED_CONFIG_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "num_labels",
    "problem_type", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "chunk_size_feed_forward", "tie_word_embeddings", "task_specific_params",
    "prefix", "finetuning_task", "tokenizer_class", "_commit_hash", "_attn_implementation",
    "_experts_implementation", "use_return_dict", "torchscript",
})


def _ignored(key: str) -> bool:
    return (key in IGNORED_CONFIG_FIELDS or key.startswith(("splitlearn", "summary_", "_attn_implementation"))
            or "dropout" in key or key.endswith("pdrop"))


def config_differences(mine: dict, theirs: dict) -> list[str]:
    """The fields (``config.to_dict()``'s, as JSON) in which two models' configs differ, each as
    ``"name: mine X, theirs Y"``, sorted; fields that do not change what the weights compute
    (:data:`IGNORED_CONFIG_FIELDS`, dropouts, heads' summaries) are left out. Empty: the same model."""
    a, b = json.loads(json.dumps(mine, default=str)), json.loads(json.dumps(theirs, default=str))
    out = []
    for key in sorted(set(a) | set(b)):
        if _ignored(key) or a.get(key) == b.get(key):
            continue
        if key not in a or key not in b:  # a field one transformers version writes and the other not
            if a.get(key, b.get(key)) is None:
                continue
        out.append(f"{key}: this side {a.get(key, '(absent)')!r}, the server {b.get(key, '(absent)')!r}")
    return out


def part_of(name: str) -> str:
    """The part a parameter belongs to: its name up to the first number (a layer:
    ``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3``), else its module
    (``model.embed_tokens.weight`` -> ``model.embed_tokens``, ``lm_head.weight`` -> ``lm_head``)."""
    words = name.split(".")
    for i, w in enumerate(words):
        if w.isdigit():
            return ".".join(words[:i + 1])
    return ".".join(words[:-1]) or name


def weight_parts(state: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None,
                 parts: Optional[set] = None) -> dict[str, str]:
    """``{part: 32 hex}``: the digest (:func:`digests`) of each part's tensors (Hugging Face
    names), cast to ``dtype`` first where given; only the parts in ``parts`` where given. Tensors on
    the meta device (weights this side never had) leave their part out."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        part = part_of(name)
        if (parts is None or part in parts) and isinstance(t, torch.Tensor) and t.is_floating_point():
            groups.setdefault(part, {})[name] = t
    groups = {p: g for p, g in groups.items() if not any(t.is_meta for t in g.values())}
    if dtype is not None:
        groups = {p: {n: t.detach().to(dtype) for n, t in g.items()} for p, g in groups.items()}
    names = sorted(groups)
    return {p: d.hex() for p, d in zip(names, digests([(groups[p], None) for p in names]))}


def weight_differences(mine: dict[str, str], theirs: dict[str, str]) -> tuple[list[str], list[str]]:
    """(the parts both sides have whose digests differ, the parts only ``theirs`` has)."""
    differ = sorted(p for p in theirs if p in mine and mine[p] != theirs[p])
    return differ, sorted(p for p in theirs if p not in mine)
