"""The speculative-decoding releases as an attack (docs/PRIVACY.md, 'Speculative decoding').

With assisted decoding over the split (``generate(assistant_model=...)``, docs/WAN.md) the client
sends the server every drafted position of every verify round, accepted or not: the server sees
the activations of draft tokens that are never emitted (``CountingRemoteCache.positions_sent``
counts them). :func:`attack_releases` runs the meter's attacks on what a capture of such a
generation recorded (:class:`Releases`, made by :func:`splitlearn.apps.defensetrain.speculative_releases`,
which drives the model classes and a server) and reports the fraction of the *released* tokens the
server recovers — emitted, prompt and rejected drafts — and how many positions were released
beyond those a plain greedy generation sends.

The attacker is the meter's (adaptive, knows the weights): learned inverters trained on the public
paragraphs through the bottom with the defense's noise, applied to every vector received, and
white-box inversion run as the server can run it: at each step the server knows which positions
it keeps (the step's ``past``: a rejected draft is cropped when the next step arrives), so it
inverts the new positions after the prefix it holds, the recovered tokens of the kept positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from ..model.partition import partition
from .attacks import LEARNED, AttackConfig, bottom_activations, invert_learned, invert_whitebox, train_inverter
from ..defense.defenses import Defense
from .meter import _vocab_size, split_corpus, windows

SPECULATIVE_ATTACKS = ("linear", "mlp", "whitebox")  # per-vector or per-step: what fits the releases


@dataclass
class Releases:
    """What the server received during one or more assisted generations, in the order sent.

    steps: per verify round ``(prompt index, past, hidden (T, d), ids (T,))`` — ``past`` the
    positions the server's cache holds before the step (it crops to it), ``hidden`` what crossed
    the cut (the defense applied), ``ids`` the tokens at those positions (the ground truth).
    outputs: per prompt, the generated sequence (prompt + emitted tokens), (L,).
    prompt_lengths: per prompt, P. positions_sent: ``CountingRemoteCache.positions_sent`` summed."""

    steps: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    prompt_lengths: list = field(default_factory=list)
    positions_sent: int = 0
    draft: str = ""
    draft_tokens: int = 0

    @property
    def released(self) -> int:
        return sum(int(h.shape[0]) for _, _, h, _ in self.steps)

    @property
    def released_plain(self) -> int:
        """What plain greedy decoding of the same output sends: P + new - 1 per prompt (the last
        token emitted is never sent)."""
        return sum(len(o) - 1 for o in self.outputs)

    def kept_mask(self) -> torch.Tensor:
        """(R,) bool per released position: kept (its token is the output's: prompt, accepted
        draft or the previous round's token) or not (a rejected draft). What the server sees too:
        the next step of the same generation crops its cache to that step's ``past``; after the
        last step the output's length says how many of its positions were accepted (the last
        token emitted is never sent)."""
        out = []
        for s, (p, past, h, _) in enumerate(self.steps):
            nxt = next((q for q, _, _, _ in self.steps[s + 1:s + 2] if q == p), None)
            end = self.steps[s + 1][1] if nxt is not None else len(self.outputs[p]) - 1
            out += [past + j < end for j in range(int(h.shape[0]))]
        return torch.tensor(out, dtype=torch.bool)


def _server_view_whitebox(bottom, rel: Releases, candidates: torch.Tensor, defense) -> torch.Tensor:
    """(R,) white-box guesses, step by step as the server sees them: the observed vectors of the
    kept prefix (cropped to ``past``) followed by the step's, inverted greedily from position 0;
    the step's positions are the guesses."""
    views: dict[int, torch.Tensor] = {}
    out = []
    for p, past, h, _ in rel.steps:
        prev = views.get(p)
        seq = h[None] if prev is None or past == 0 else torch.cat([prev[:, :past], h[None]], 1)  # (1, L, d)
        views[p] = seq
        out.append(invert_whitebox(bottom, seq, candidates, defense)[0, past:])
    return torch.cat(out)


def attack_releases(model, cut: Sequence[int], defense: Optional[Defense], rel: Releases, *, tokenizer,
                    attacks: Sequence[str] = SPECULATIVE_ATTACKS, config: Optional[AttackConfig] = None,
                    seq_len: int = 32, public_texts: Optional[Sequence[str]] = None, delta: float = 1e-5,
                    attacker_model=None) -> dict:
    """Attack the releases ``rel`` of a generation over ``model`` split at ``cut`` with ``defense``.
    The inverters train on ``public_texts`` (default: the public paragraphs) through the bottom of
    ``attacker_model`` (default ``model``). Returns the JSON-able ``speculative`` field of a row:
    released counts, each attack's recovery over every released position, the best, its recovery
    over the rejected drafts and over the kept positions, what always guessing the public text's
    commonest token scores on the released tokens (``baseline_most_frequent``), and ε per
    generation for the positions released (``epsilon``) and for those plain decoding of the same
    output releases (``epsilon_plain``)."""
    t0 = time.perf_counter()
    attacks = tuple(attacks)
    for a in attacks:
        if a not in SPECULATIVE_ATTACKS:
            raise ConfigError(f"the speculative attack runs {', '.join(SPECULATIVE_ATTACKS)}, got {a!r}")
    if not rel.steps:
        raise ConfigError("nothing was released")
    config = config or AttackConfig()
    attacker = attacker_model if attacker_model is not None else model
    was = attacker.training
    attacker.eval()
    try:
        bottom = partition(attacker, tuple(cut)).bottom
        pub_ids = windows(tokenizer, public_texts if public_texts is not None else split_corpus()[0],
                          seq_len, max(1, seq_len // 4))  # (Np, T)
        h_pub = bottom_activations(bottom, pub_ids)  # (Np, T, d)
        classes = pub_ids.unique()  # (K,)
        y = torch.cat([h for _, _, h, _ in rel.steps]).float()  # (R, d)
        truth = torch.cat([ids for _, _, _, ids in rel.steps])  # (R,)
        kept = rel.kept_mask()
        guesses = {}
        for kind in (a for a in attacks if a in LEARNED):
            inv = train_inverter(kind, h_pub, pub_ids, defense, classes, config)
            guesses[kind] = invert_learned(inv, y[None], classes)[0]  # (R,)
        if "whitebox" in attacks:
            vocab = min(_vocab_size(tokenizer), model.config.vocab_size)
            cands = torch.arange(vocab) if vocab <= config.whitebox_candidates else classes
            guesses["whitebox"] = _server_view_whitebox(bottom, rel, cands, defense)
    finally:
        attacker.train(was)
    rate = {k: (g == truth).float().mean().item() for k, g in guesses.items()}
    common = pub_ids.flatten().bincount().argmax()  # always guessing the public text's commonest token
    baseline = (truth == common).float().mean().item()
    best = max(rate, key=lambda k: (rate[k], -attacks.index(k)))
    hit = guesses[best] == truth

    def part(m):
        return None if not m.any() else hit[m].float().mean().item()

    released = rel.released
    eps = None
    if defense is not None and hasattr(defense, "noise_multiplier"):
        # one generation's releases per prompt compose: the largest per-prompt count is per-sequence ε
        per = {}
        for p, _, h, _ in rel.steps:
            per[p] = per.get(p, 0) + int(h.shape[0])
        eps = defense.epsilon(delta, steps=1, tokens=max(per.values()))
        eps_plain = defense.epsilon(delta, steps=1, tokens=max(len(o) - 1 for o in rel.outputs))
    return {
        "draft": rel.draft, "draft_tokens": rel.draft_tokens, "prompts": len(rel.outputs),
        "prompt_tokens": sum(rel.prompt_lengths),
        "new_tokens": sum(len(o) - p for o, p in zip(rel.outputs, rel.prompt_lengths)),
        "steps": len(rel.steps), "released": released, "positions_sent": rel.positions_sent,
        "released_plain": rel.released_plain, "released_beyond_plain": released - rel.released_plain,
        "rejected_drafts": int((~kept).sum()),
        "attacks": rate, "token_recovery": rate[best], "best_attack": best,
        "token_recovery_rejected": part(~kept), "token_recovery_kept": part(kept),
        "baseline_most_frequent": baseline,
        "epsilon": eps, "epsilon_plain": None if eps is None else eps_plain,
        "delta": delta if eps is not None else None, "seconds": time.perf_counter() - t0,
    }
