"""``measure_leakage``: how many held-out tokens the best attack reads back at a cut, and what
the defense costs in perplexity. The protocol: docs/PRIVACY.md, 'Measured'.

Any family the adapter cuts (:mod:`splitlearn.model.arch`, docs/MODELS.md): the cut, the
perplexities and the gradient channel go through :func:`~splitlearn.model.partition.partition`;
the learned inverters read activations only; the white-box and optimisation attacks are GPT-2's
(:func:`~.attacks.attacks_for`)."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..model.data import ByteTokenizer, get_tokenizer, is_bytes, load_corpus
from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.loading import load_model
from ..model.partition import partition, validate_cuts
from ..model.segments import loss_from_logits
from .attacks import (ATTACKS, LEARNED, AttackConfig, attacks_for, bottom_activations, check_attacks, check_family,
                      invert_learned, invert_optimize, invert_whitebox, inverter_log_probs, recovery,
                      train_inverter)
from ..defense.defenses import Defense

log = logging.getLogger(__name__)


@dataclass
class LeakageReport:
    """What :func:`measure_leakage` found; :meth:`as_dict` is JSON-able."""

    cut: tuple[int, ...]                 # (c,) 2-way or (c1, c2) U-shape
    defense: dict                        # Defense.describe(), {"name": "none"} without one
    token_recovery: float                # best attack's top-1 fraction from the activations
    best_attack: str                     # which attack achieved it
    attacks: dict[str, float]            # every attack's recovery
    perplexity: float                    # private windows, split model with the defense
    perplexity_unsplit: float            # the same windows, the unsplit model
    labels_reach_server: bool            # 2-way: the labels (= the text) go to the server
    training_token_recovery: float       # 1.0 if the labels reach the server, else token_recovery
    epsilon: Optional[float] = None      # at delta, GaussianNoise only (inf without noise)
    delta: Optional[float] = None
    releases: Optional[int] = None       # released vectors accounted (seq_len, sent once)
    seq_len: int = 32                    # tokens per window
    public_tokens: int = 0               # tokens the inverters trained on (with overlaps)
    private_tokens: int = 0              # tokens to recover
    seconds: float = 0.0                 # wall time of the measurement
    notes: list[str] = field(default_factory=list)
    defense_trained: bool = False        # the model was fine-tuned with the defense (defensetrain)
    perplexity_undefended: Optional[float] = None  # the undefended model (before any fine-tuning)
    perplexity_test_time: Optional[float] = None   # the undefended model with the defense inserted
    finetune_steps: int = 0              # defense-aware fine-tuning: steps (0: none)
    finetune_seconds: float = 0.0        # ... and its wall time (when it was run, cached or not)
    epsilon_finetune: Optional[float] = None  # at delta, for a token of the fine-tuning text
    releases_finetune: Optional[int] = None   # released vectors that can depend on it (mean)
    finetune: Optional[dict] = None      # the fine-tuning's finetune.json
    perplexity_without_server: Optional[float] = None  # U-shape: the server's blocks skipped
    perplexity_mean_update: Optional[float] = None  # U-shape: the server's update averaged over other windows
    attacker_knows: str = "finetuned"    # weights the attacker uses: the client's own ("finetuned",
                                         # fine-tuned where the row was) or the public reference's
    token_recovery_gradient: Optional[float] = None  # U-shape training: best attack on the gradient
    gradient_attacks: Optional[dict] = None          # the client sends at the second cut (per kind)
    epsilon_gradient: Optional[float] = None  # at delta, per window: the gradient defense's releases
    epsilon_training: Optional[float] = None  # ... the activations' and the gradients' composed

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cut"] = list(self.cut)
        for k in ("epsilon", "epsilon_finetune", "epsilon_gradient", "epsilon_training"):
            if d[k] is not None and math.isinf(d[k]):
                d[k] = "inf"  # JSON has no infinity
        return d


def split_corpus(text: Optional[str] = None, private_paragraphs: int = 2) -> tuple[list[str], list[str]]:
    """(public, private) paragraphs of ``text`` (default: the shipped corpus): the last
    ``private_paragraphs`` are private."""
    paras = [p.strip() for p in (text if text is not None else load_corpus()).split("\n\n") if p.strip()]
    if len(paras) <= private_paragraphs:
        raise ConfigError(f"the text has {len(paras)} paragraphs; need more than {private_paragraphs}")
    return paras[:-private_paragraphs], paras[-private_paragraphs:]


def windows(tokenizer, texts: Sequence[str], seq_len: int, stride: Optional[int] = None) -> torch.Tensor:
    """(N, seq_len) long: windows of the texts' concatenated tokens, every ``stride`` tokens
    (default: disjoint)."""
    ids: list[int] = []
    for t in texts:
        ids += list(tokenizer.encode(t + "\n\n"))
    stride = stride or seq_len
    if len(ids) < seq_len:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than seq_len={seq_len}")
    data = torch.tensor(ids, dtype=torch.long)
    return torch.stack([data[s:s + seq_len] for s in range(0, len(data) - seq_len + 1, stride)])


def default_tokenizer(model, source=None):
    """The tokenizer of ``source`` (or the model's ``_name_or_path``); bytes for specs."""
    src = source if isinstance(source, str) else (getattr(model.config, "_name_or_path", "") or None)
    tok = get_tokenizer(src) if src else ByteTokenizer()
    if is_bytes(tok) and model.config.vocab_size < _vocab_size(tok):
        raise ConfigError(f"the model's vocabulary ({model.config.vocab_size}) is smaller than the "
                          f"byte tokenizer's; pass tokenizer=")
    return tok


def max_positions(config) -> Optional[int]:
    """The longest sequence the model takes (``max_position_embeddings``; GPT-2's config maps it to
    its own field), or None when the config states none."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def n_layers(model) -> int:
    """The number of layers of a transformers causal LM, any family (the adapter's count)."""
    return arch_of(model.config).n_layers


def _same_shape(a, b) -> bool:
    fields = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    return all(getattr(a, f, None) == getattr(b, f, None) for f in fields)


def _vocab_size(tokenizer) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return tokenizer.vocab_size


@torch.no_grad()
def perplexity_without_server(model, cut: tuple[int, ...], ids: torch.Tensor, batch: int = 32) -> float:
    """U-shape: the perplexity of ``ids`` (N, T) through the client's blocks alone, the server's
    blocks skipped (their update taken as zero): what the model is worth without the server. A
    defense whose perplexity is no better than this has made the server's blocks useless."""
    if len(cut) != 2:
        raise ConfigError(f"the client runs without the server only in a U-shape, got cut {tuple(cut)}")
    part = partition(model, cut)
    dev = next(model.parameters()).device
    loss = 0.0
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch].to(dev)  # (b, T)
        loss += loss_from_logits(part.segments[2](part.bottom(x)), x).item() * len(x)
    return math.exp(loss / len(ids))


@torch.no_grad()
def perplexity_mean_update(model, cut: tuple[int, ...], ids: torch.Tensor, defense: Optional[Defense] = None,
                           seed: int = 0, batch: int = 32) -> float:
    """U-shape: the perplexity of ``ids`` (N, T), N >= 2, when the server's *update* (its output minus
    its input) for window i is replaced by the mean, per position, of its updates for the *other*
    windows (defended as sent), added to what the client's last blocks otherwise take (the clean
    activations with the residual design, what was sent without it). That keeps the part of the
    server's contribution that does not depend on the text (its mean, the positions) and drops the
    part that does: ``perplexity_mean_update - perplexity`` is what the server contributes *about the
    text*, where ``perplexity_without_server - perplexity`` also counts a fixed offset the client's
    last blocks learned to expect."""
    if len(cut) != 2:
        raise ConfigError(f"the server's update is averaged only in a U-shape, got cut {tuple(cut)}")
    if len(ids) < 2:
        raise ConfigError(f"averaging the server's update over the other windows needs >= 2 windows, "
                          f"got {len(ids)}")
    part = partition(model, cut)
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    residual = uses_residual(defense, cut)
    bases, updates = [], []
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch].to(dev)  # (b, T)
        clean = part.bottom(x)  # (b, T, d)
        y = clean if defense is None else defense.apply(clean, generator=gen)  # (b, T, d)
        bases.append(clean if residual else y)
        updates.append(part.segments[1](y) - y)  # (b, T, d)
    base, update = torch.cat(bases), torch.cat(updates)  # (N, T, d) each
    others = (update.sum(0, keepdim=True) - update) / (len(ids) - 1)  # (N, T, d): leave-one-out means
    loss = 0.0
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch].to(dev)
        logits = part.segments[2](base[i:i + batch] + others[i:i + batch])  # (b, T, V)
        loss += loss_from_logits(logits, x).item() * len(x)
    return math.exp(loss / len(ids))


def uses_residual(defense: Optional[Defense], cut: Sequence[int]) -> bool:
    """Whether ``defense`` asks for the U-shape residual design; ConfigError at a 2-way cut."""
    if not getattr(defense, "residual", False):
        return False
    if len(cut) != 2:
        raise ConfigError(f"the residual design keeps the residual stream on the client between two "
                          f"cuts: it needs a U-shape, got cut {tuple(cut)}")
    return True


@torch.no_grad()
def perplexities(model, cut: tuple[int, ...], ids: torch.Tensor, defense: Optional[Defense],
                 seed: int = 0, batch: int = 32) -> tuple[float, float]:
    """(split with the defense at the first cut, unsplit) perplexity of ``ids`` (N, T)."""
    part = partition(model, cut)
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    split_loss = whole_loss = 0.0
    residual = uses_residual(defense, cut)
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch].to(dev)  # (b, T)
        clean = h = part.bottom(x)  # (b, T, d)
        if defense is not None:
            h = defense.apply(h, generator=gen)
        if residual:  # the server's update on the client's clean activations
            h = clean + (part.segments[1](h) - h)  # (b, T, d)
            h = part.segments[2](h)
        else:
            for seg in part.segments[1:]:
                h = seg(h)
        n = len(x)
        split_loss += loss_from_logits(h, x).item() * n
        whole_loss += loss_from_logits(model(x).logits, x).item() * n
    return math.exp(split_loss / len(ids)), math.exp(whole_loss / len(ids))


def measure_leakage(model: Union[str, torch.nn.Module], cut: Union[int, Sequence[int]], *,
                    defense: Optional[Defense] = None, texts: Optional[Sequence[str]] = None,
                    public_texts: Optional[Sequence[str]] = None, tokenizer=None,
                    attacks: Optional[Sequence[str]] = None, seq_len: int = 32, delta: float = 1e-5,
                    accountant: str = "rdp", config: Optional[AttackConfig] = None,
                    max_private_tokens: Optional[int] = None, seed: int = 0,
                    attacker_model: Optional[torch.nn.Module] = None,
                    gradient_attacks: Sequence[str] = ()) -> LeakageReport:
    """Measure what the server can read back at ``cut``.

    model: a transformers causal LM of any family the adapter cuts (``GPT2LMHeadModel``,
    ``LlamaForCausalLM``, ...) or a :func:`~splitlearn.load_model` source.
    cut: ``c`` / ``(c,)`` for the 2-way split, ``(c1, c2)`` for the U-shape.
    defense: applied to what leaves the client (None: nothing).
    texts / public_texts: private and public text (default: the shipped corpus, split).
    tokenizer: default: the model's own (bytes for specs and random inits).
    attacks: a subset of ``ATTACKS`` (default: every attack the family has, :func:`~.attacks.attacks_for`:
    the learned inverters only outside GPT-2, said in the report's notes); seq_len: tokens per
    window (<= the model's ``max_position_embeddings``).
    delta, accountant: for epsilon (GaussianNoise only); config: the attacker's budget.
    max_private_tokens: recover at most this many private tokens (whole windows).
    attacker_model: the weights the attacker *believes* the client has (a secret client: the public
    reference before the client's private fine-tuning); the learned inverters train on its
    activations, the white-box and optimisation attacks run its bottom, and the row says
    ``attacker_knows="public"``. None: the attacker knows the measured model (pessimistic).
    gradient_attacks: learned inverters (a subset of ``LEARNED``) run on the gradient the client
    sends at the second cut of a U-shape in training (``token_recovery_gradient``); ConfigError at
    a 2-way cut (there the labels themselves reach the server).
    Raises :class:`ConfigError` on a cut out of range, an unknown attack, a bad defense."""
    t0 = time.perf_counter()
    defaulted = attacks is None
    if not defaulted:
        attacks = check_attacks(attacks)
    config = config or AttackConfig(seed=seed)
    if defense is not None and not isinstance(defense, Defense):
        raise ConfigError(f"defense must be a splitlearn.privacy.Defense, got {type(defense).__name__}")
    source = model if isinstance(model, str) else None
    if isinstance(model, str):
        model = load_model(model, seed=seed)
    cut = validate_cuts(cut, n_layers(model))
    family_attacks = attacks_for(model.config)
    if defaulted:
        attacks = family_attacks
    check_family(attacks, model.config)
    uses_residual(defense, cut)
    if getattr(defense, "defends_gradient", False) and len(cut) != 2:
        raise ConfigError(f"a defense of the gradient channel (grad_clip, grad_sigma) needs a U-shape "
                          f"(the gradient sent back at the second cut), got cut {tuple(cut)}")
    gradient_attacks = tuple(gradient_attacks)
    for a in gradient_attacks:
        if a not in LEARNED:
            raise ConfigError(f"unknown gradient attack {a!r}; known: {', '.join(LEARNED)}")
    if gradient_attacks and len(cut) != 2:
        raise ConfigError(f"the gradient attack reads the gradient at the second cut of a U-shape, "
                          f"got cut {tuple(cut)} (2-way: the labels reach the server anyway)")
    if attacker_model is not None:
        a = getattr(attacker_model, "config", None)
        if not isinstance(attacker_model, torch.nn.Module) or a is None or not _same_shape(a, model.config):
            raise ConfigError("attacker_model must be a model of the measured model's family and shape "
                              "(model_type, num_hidden_layers, hidden_size, vocab_size)")
    limit = max_positions(model.config)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2 or (limit and seq_len > limit):
        raise ConfigError(f"seq_len must be an integer in [2, max_position_embeddings={limit}], got {seq_len!r}")
    tokenizer = tokenizer or default_tokenizer(model, source)
    if texts is None or public_texts is None:
        pub, priv = split_corpus()
        texts = priv if texts is None else texts
        public_texts = pub if public_texts is None else public_texts
    was_training = model.training
    attacker = attacker_model if attacker_model is not None else model
    was_attacker = attacker.training
    model.eval()
    attacker.eval()
    try:
        report = _measure(model, cut, defense, texts, public_texts, tokenizer, attacks, seq_len,
                          delta, accountant, config, max_private_tokens, seed, attacker, gradient_attacks)
    finally:
        model.train(was_training)
        attacker.train(was_attacker)
    if attacker_model is not None:
        report.attacker_knows = "public"
    if defaulted and family_attacks != ATTACKS:
        report.notes.append(f"{model.config.model_type}: the learned inverters only (the white-box and "
                            f"optimisation attacks are GPT-2's; docs/MODELS.md)")
    report.seconds = time.perf_counter() - t0
    log.info("cut %s %s: recovery %.3f (%s), ppl %.2f / %.2f, %.1f s", cut, report.defense,
             report.token_recovery, report.best_attack, report.perplexity,
             report.perplexity_unsplit, report.seconds)
    return report


def _measure(model, cut, defense, texts, public_texts, tokenizer, attacks, seq_len, delta,
             accountant, config, max_private_tokens, seed, attacker=None, gradient_attacks=()) -> LeakageReport:
    part = partition(model, cut)
    attacker = model if attacker is None else attacker
    bottom = partition(attacker, cut).bottom  # the bottom the attacker knows (or believes)
    dev = next(model.parameters()).device
    pub_ids = windows(tokenizer, public_texts, seq_len, max(1, seq_len // 4))  # (Np, T)
    priv_ids = windows(tokenizer, texts, seq_len)  # (N, T)
    if max_private_tokens is not None:
        priv_ids = priv_ids[:max(1, max_private_tokens // seq_len)]
    h_pub = bottom_activations(bottom, pub_ids)  # (Np, T, d): the attacker's model on public text
    h_priv = bottom_activations(part.bottom, priv_ids)  # (N, T, d): the client's real bottom
    gen = torch.Generator(device=dev).manual_seed(seed + 1000)  # the victim's noise
    with torch.no_grad():
        y_priv = h_priv if defense is None else defense.apply(h_priv, generator=gen)  # (N, T, d)
    classes = pub_ids.unique()  # (K,) what a learned inverter can name
    results: dict[str, float] = {}
    best_inv = None
    for kind in (a for a in attacks if a in LEARNED):
        inv = train_inverter(kind, h_pub, pub_ids, defense, classes, config)
        results[kind] = recovery(invert_learned(inv, y_priv, classes), priv_ids)
        if best_inv is None or results[kind] > results[best_inv[0]]:
            best_inv = (kind, inv)
        log.info("cut %s: %s inverter recovers %.3f", cut, kind, results[kind])
    notes = []
    if "whitebox" in attacks:
        vocab = min(_vocab_size(tokenizer), model.config.vocab_size)
        if vocab <= config.whitebox_candidates:
            cands = torch.arange(vocab)
        elif best_inv is not None:
            cands = invert_learned(best_inv[1], y_priv, classes, topk=config.whitebox_candidates)
            notes.append(f"white-box candidates: the {best_inv[0]} inverter's top "
                         f"{config.whitebox_candidates} per position (vocabulary {vocab})")
        else:
            cands = classes
            notes.append(f"white-box candidates: the {len(classes)} token ids of the public text")
        results["whitebox"] = recovery(invert_whitebox(bottom, y_priv, cands, defense), priv_ids)
        log.info("cut %s: white-box inversion recovers %.3f", cut, results["whitebox"])
    if "optimize" in attacks:
        prior = None if best_inv is None else inverter_log_probs(best_inv[1], y_priv)  # (N, T, K)
        if best_inv is not None:
            notes.append(f"optimisation attack: started from, and regularised by, the {best_inv[0]} inverter")
        results["optimize"] = recovery(invert_optimize(bottom, y_priv, classes, defense, prior, config),
                                       priv_ids)
        log.info("cut %s: optimisation attack recovers %.3f", cut, results["optimize"])
    best = max(results, key=lambda k: (results[k], -attacks.index(k)))
    grad_results = None
    if gradient_attacks:
        grad_results = gradient_recovery(model, attacker, cut, defense, pub_ids, priv_ids, classes,
                                         gradient_attacks, config, seed)
        notes.append("gradient channel: learned inverters from the gradient the client sends at the "
                     "second cut (training) to the labels, the next tokens; recovery over positions "
                     "1..T-1 of each window")
    grad_best = None if grad_results is None else max(grad_results.values())
    ppl, ppl_whole = perplexities(model, cut, priv_ids, defense, seed)
    two_way = len(cut) == 1
    ppl_alone = None if two_way else perplexity_without_server(model, cut, priv_ids)
    ppl_mean = (None if two_way or len(priv_ids) < 2 else
                perplexity_mean_update(model, cut, priv_ids, defense, seed))
    if two_way:
        notes.append("2-way split: during training the labels, which are the input text itself, "
                     "are sent to the server; no defense of the activations protects them")
    eps = rel = None
    if defense is not None and hasattr(defense, "noise_multiplier"):
        rel = seq_len
        eps = defense.epsilon(delta, steps=1, tokens=seq_len, accountant=accountant)
    eps_g = eps_t = None
    if getattr(defense, "defends_gradient", False):
        eps_g = defense.gradient_epsilon(delta, steps=1, tokens=seq_len, accountant=accountant)
        eps_t = defense.training_epsilon(delta, steps=1, tokens=seq_len, accountant=accountant)
    return LeakageReport(
        cut=tuple(cut), defense=defense.describe() if defense is not None else {"name": "none"},
        token_recovery=results[best], best_attack=best, attacks=results, perplexity=ppl,
        perplexity_unsplit=ppl_whole, perplexity_undefended=ppl_whole, labels_reach_server=two_way,
        perplexity_without_server=ppl_alone, perplexity_mean_update=ppl_mean,
        training_token_recovery=1.0 if two_way else max(results[best], grad_best or 0.0),
        token_recovery_gradient=grad_best,
        gradient_attacks=grad_results, epsilon=eps, epsilon_gradient=eps_g, epsilon_training=eps_t,
        delta=delta if eps is not None else None, releases=rel, seq_len=seq_len,
        public_tokens=pub_ids.numel(), private_tokens=priv_ids.numel(), notes=notes)


def cut_gradients(model, cut: tuple[int, ...], ids: torch.Tensor, defense: Optional[Defense],
                  generator: Optional[torch.Generator] = None, batch: int = 32,
                  server_model=None) -> torch.Tensor:
    """U-shape training: the gradient (N, T, d) the client sends the server at the second cut for
    the windows ``ids`` (N, T): the gradient of the language-model loss (summed over the tokens, so
    independent of the batch size, which the server knows) with respect to the server's output,
    the defense applied at the first cut as in training (the residual design: the client's top
    runs on ``clean + (s(y) - y)``, whose gradient with respect to ``s(y)`` is the same), and a
    gradient defense (``GaussianNoise.defend_gradient``) to the gradient itself, as the model
    classes apply it (``generator`` draws both noises).
    ``server_model``: whose middle blocks the server runs (default ``model``): an attacker who
    believes the client is public still knows the server's own, possibly fine-tuned, blocks."""
    part = partition(model, cut)
    server = partition(server_model, cut).segments[1] if server_model is not None else part.segments[1]
    dev = next(model.parameters()).device
    residual = uses_residual(defense, cut)
    defends = getattr(defense, "defends_gradient", False)
    out = []
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch].to(dev)  # (b, T)
        with torch.no_grad():
            clean = part.bottom(x)  # (b, T, d)
            y = clean if defense is None else defense.apply(clean, generator=generator)
            s = server(y)  # (b, T, d): the server's output
        s = s.detach().requires_grad_()
        top_in = clean + (s - y) if residual else s
        with torch.enable_grad():
            logits = part.segments[2](top_in)  # (b, T, V)
            loss = loss_from_logits(logits, x) * (x.shape[0] * (x.shape[1] - 1))  # summed
            g, = torch.autograd.grad(loss, s)
        if defends:  # what the model classes send: on the mean loss's gradient, rescaled
            n = x.shape[0] * max(x.shape[1] - 1, 1)
            g = defense.defend_gradient(g / n, generator=generator) * n
        out.append(g.float())
    return torch.cat(out)  # (N, T, d)


def gradient_recovery(model, attacker, cut, defense, pub_ids, priv_ids, classes, kinds,
                      config: AttackConfig, seed: int = 0) -> dict[str, float]:
    """The gradient channel of the U-shape: per learned inverter kind, the fraction of the private
    labels (tokens 1..T-1 of each window) recovered from the gradients the client sends at the
    second cut. The inverters train on the gradients of the public windows through ``attacker``
    (the weights the attacker knows or believes), with its own draws of the defense's noise (one
    per window; with a gradient defense, its clip and noise too, as the model classes send it)."""
    dev = next(model.parameters()).device
    g_priv = cut_gradients(model, cut, priv_ids, defense,  # the victim's gradients, its own noise
                           torch.Generator(device=dev).manual_seed(seed + 1000))
    g_pub = cut_gradients(attacker, cut, pub_ids, defense,
                          torch.Generator(device=dev).manual_seed(seed + 2000), server_model=model)
    out = {}
    for kind in kinds:
        inv = train_inverter(kind, g_pub[:, :-1], pub_ids[:, 1:], None, classes, config)
        out[kind] = recovery(invert_learned(inv, g_priv[:, :-1], classes), priv_ids[:, 1:])
        log.info("cut %s: %s inverter on the gradient at the second cut recovers %.3f", cut, kind, out[kind])
    return out


def private_windows(tokenizer, texts: Optional[Sequence[str]] = None, seq_len: int = 32,
                    max_private_tokens: Optional[int] = None) -> torch.Tensor:
    """The private windows (N, seq_len) :func:`measure_leakage` recovers and scores perplexity on."""
    ids = windows(tokenizer, texts if texts is not None else split_corpus()[1], seq_len)
    return ids if max_private_tokens is None else ids[:max(1, max_private_tokens // seq_len)]


@torch.no_grad()
def median_token_norm(model, cut: Union[int, Sequence[int]], *, texts: Optional[Sequence[str]] = None,
                      tokenizer=None, seq_len: int = 32) -> float:
    """Median L2 norm of the bottom's per-token output on public text: a natural ``clip``
    for :class:`~splitlearn.defense.defenses.GaussianNoise` (half the tokens are clipped)."""
    cut = validate_cuts(cut, n_layers(model))
    tokenizer = tokenizer or default_tokenizer(model)
    ids = windows(tokenizer, texts if texts is not None else split_corpus()[0], seq_len)
    was = model.training
    model.eval()
    h = bottom_activations(partition(model, cut).bottom, ids)  # (N, T, d)
    model.train(was)
    return h.norm(dim=-1).median().item()


def median_token_grad_norm(model, cut: Union[int, Sequence[int]], *, texts: Optional[Sequence[str]] = None,
                           tokenizer=None, seq_len: int = 32) -> float:
    """Median L2 norm of the per-token gradient the client sends back at the second cut of a
    U-shape (:func:`cut_gradients`: the language-model loss summed over the tokens, no defense) on
    public text, over the positions that predict a token: a natural ``grad_clip`` for
    :class:`~splitlearn.defense.defenses.GaussianNoise` (half the tokens are clipped), as :func:`median_token_norm`
    is for ``clip``. Raises :class:`ConfigError` for a cut that is not a U-shape."""
    cut = validate_cuts(cut, n_layers(model))
    if len(cut) != 2:
        raise ConfigError(f"the gradient sent back at the second cut needs a U-shape, got cut {tuple(cut)}")
    tokenizer = tokenizer or default_tokenizer(model)
    ids = windows(tokenizer, texts if texts is not None else split_corpus()[0], seq_len)
    was = model.training
    model.eval()
    g = cut_gradients(model, cut, ids, None)  # (N, T, d); the last position predicts nothing
    model.train(was)
    return g[:, :-1].norm(dim=-1).median().item()
