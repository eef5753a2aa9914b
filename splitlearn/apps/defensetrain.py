"""Defense-aware fine-tuning (docs/PRIVACY.md, 'Defenses trained in'): the meter's reference model
fine-tuned *with* a defense on what crosses the cut, over the split, through the model classes.

    path = finetune_defense(reference_dir, (1, 5), GaussianNoise(sigma=2, clip=2.4), steps=200)
    model = splitlearn.load_model(path)          # the fine-tuned whole model, measured by the meter

The client is the family's split model (:class:`~splitlearn.hf.auto.AutoSplitModelForCausalLM`:
``SplitGPT2LMHeadModel`` for GPT-2, ``Split<Name>`` for any other family) with the defense
(``model.defense``: its noise on every activation sent, its extra loss, e.g. NoPeek's, added to
the loss), the server a segment server of this process reached at an ``inproc://`` URL (the same
app as ``python -m splitlearn.server``, without a socket); both sides train with AdamW. The
client's and the server's weights are then put back into one ``*ForCausalLM`` of the family (2-way: the
server's LM head is its own, untied, copy), saved and cached per setting like
:func:`~splitlearn.privacy.train_reference`.

This module is also the driver of ``python -m splitlearn.privacy`` (:func:`main`): it sits above
``privacy`` (which the model classes import) and ``server`` (which it starts).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ..model.data import ByteTokenizer, lm_batches
from ..errors import ConfigError
from ..model.loading import load_model
from ..model.partition import validate_cuts
from ..defense.defenses import Defense
from ..privacy.meter import max_positions, n_layers, split_corpus
from ..privacy.spent import describe as describe_spent, spent
from ..privacy.reference import FINETUNE_JSON, default_cache_dir, finetune_info  # noqa: F401 (re-export)

log = logging.getLogger(__name__)

def _tag(source: Union[str, Path], cut: tuple[int, ...], defense: Defense, steps: int, batch_size: int,
         seq_len: int, lr: float, seed: int) -> str:
    d = defense.describe()
    params = json.dumps(d, sort_keys=True)
    digest = hashlib.sha256(f"{Path(source).resolve() if Path(source).exists() else source}|{params}"
                            .encode()).hexdigest()[:10]
    return (f"{Path(str(source)).name.replace(':', '_')}-cut{'_'.join(map(str, cut))}-{d['name']}-{digest}"
            f"-steps{steps}-b{batch_size}-t{seq_len}-lr{lr:g}-seed{seed}")


def finetune_defense(source: Union[str, Path], cut: Union[int, Sequence[int]], defense: Defense, steps: int, *,
                     batch_size: int = 16, seq_len: int = 64, lr: float = 1e-3, seed: int = 0,
                     texts: Optional[Sequence[str]] = None, cache_dir: Union[str, Path, None] = None,
                     progress: bool = True) -> Path:
    """Fine-tune ``source`` (a model directory, e.g. :func:`~splitlearn.privacy.train_reference`'s,
    or a spec) split at ``cut`` with ``defense`` applied to what the client sends, ``steps`` AdamW
    steps of ``batch_size`` x ``seq_len`` windows of ``texts`` (default: the public paragraphs of
    the shipped corpus, bytes); return the ``save_pretrained`` directory, cached per setting under
    ``cache_dir`` (default ``<privacy cache>/defended``). Its ``finetune.json``: the setting,
    ``seconds``, the training losses (the task's, without the defense's extra loss) of the first
    and last tenth of the steps. Raises :class:`ConfigError` on bad input."""
    for name, v in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"defense fine-tuning: {name} must be a positive integer, got {v!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"defense fine-tuning: lr must be > 0, got {lr!r}")
    if not isinstance(defense, Defense):
        raise ConfigError(f"defense must be a splitlearn.privacy.Defense, got {type(defense).__name__}")
    base = load_model(str(source), seed=seed)
    cut = validate_cuts(cut, n_layers(base))
    limit = max_positions(base.config)
    if limit and seq_len > limit:
        raise ConfigError(f"seq_len={seq_len} is longer than the model's positions (max_position_embeddings={limit})")
    if base.config.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"{source} has a vocabulary of {base.config.vocab_size}; defense fine-tuning "
                          f"trains on bytes (257)")
    out = Path(cache_dir or default_cache_dir() / "defended") / _tag(source, cut, defense, steps, batch_size,
                                                                     seq_len, lr, seed)
    if (out / "config.json").is_file() and (out / FINETUNE_JSON).is_file():
        log.info("defense-fine-tuned model cached at %s", out)
        return out
    ids = ByteTokenizer().encode("\n\n".join(texts if texts is not None else split_corpus()[0]))
    t0 = time.perf_counter()
    losses, client, server = _train(source, cut, defense, steps, batch_size, seq_len, lr, seed, ids, progress)
    seconds = time.perf_counter() - t0
    model = _assemble(base, cut, client, server)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tenth = max(1, steps // 10)
    info = {"source": str(source), "cut": list(cut), "defense": defense.describe(), "steps": steps,
            "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed, "seconds": seconds,
            "loss_first": sum(losses[:tenth]) / tenth, "loss_last": sum(losses[-tenth:]) / tenth,
            "tokens": len(ids), "windows_sent": steps * batch_size}
    info["privacy_spent"] = spent(defense, windows=steps * batch_size, seq_len=seq_len, tokens=len(ids))
    (out / FINETUNE_JSON).write_text(json.dumps(info, indent=2))
    log.info("fine-tuning %s", describe_spent(info["privacy_spent"]))  # epsilon at delta 1e-5, or none
    log.info("fine-tuned %s at cut %s with %s: %d steps in %.1f s, loss %.3f -> %.3f -> %s", source, cut,
             info["defense"], steps, seconds, info["loss_first"], info["loss_last"], out)
    return out


def _train(source, cut, defense, steps, batch_size, seq_len, lr, seed, ids, progress):
    """The training run: (task losses per step, client state dict, server state dict (HF names))."""
    from ..hf.auto import AutoSplitModelForCausalLM
    from ..server.config import ServerConfig
    from ..server.http.app import create_app
    from ..transport.inproc import serve_inproc, unserve

    token = secrets.token_hex(16)
    cfg = ServerConfig(model=str(source), cuts=tuple(cut), optimizer="adamw", lr=lr, weight_decay=0.01,
                       seed=seed, tokens=(token,), torch_threads=torch.get_num_threads())
    app = create_app(cfg)
    rt = app.extensions["splitlearn"]
    url = serve_inproc(app)
    model = None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the defense's noise draws
            model = AutoSplitModelForCausalLM.from_pretrained(str(source), server=url, token=token, seed=seed,
                                                              defense=defense, client_id="defense-finetune")
            model.train()
            opt = model.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01))
            bar = None
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=steps, desc=f"fine-tuning with {defense.name} at cut "
                           f"{','.join(map(str, cut))}", unit="step")
            losses = []
            for batch in lm_batches(ids, batch_size, seq_len, seed=seed + 1, steps=steps):
                loss = model(batch, labels=batch).loss
                extra = model.defense_loss  # the defense's own term (NoPeek), not the task's
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item() - (extra.item() if extra is not None else 0.0))
                if not math.isfinite(losses[-1]):
                    raise ConfigError(f"defense fine-tuning diverged at step {len(losses)} (loss "
                                      f"{losses[-1]}); try a lower lr")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if bar is not None:
                bar.close()
            model.flush()  # the last step's apply reaches the server
        client = {k: v.detach().clone() for k, v in model.state_dict().items()}
        server = rt.compute.run(lambda: {k: v.detach().clone() for k, v in rt.segment.hf_state_dict().items()})
    finally:
        if model is not None:
            model.remote.close()
        unserve(url)
        rt.compute.close()
    return losses, client, server


def _assemble(base, cut, client: dict, server: dict):
    """``base`` (the untuned ``*ForCausalLM``) with the client's and the server's trained weights;
    2-way: untied, the LM head being the server's own copy."""
    if len(cut) == 1:  # the server trained its own LM head: keep it
        base.config.tie_word_embeddings = False
        base.get_output_embeddings().weight = torch.nn.Parameter(
            base.get_input_embeddings().weight.detach().clone())
    state = base.state_dict()
    got = {}
    for k, v in list(client.items()) + list(server.items()):
        if k in state and not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias"):
            got[k] = v
    missing = [k for k in state if k not in got and k.endswith((".weight", ".bias"))
               and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing:
        raise ConfigError(f"defense fine-tuning: no trained value for {missing[:3]} (of {len(missing)})")
    base.load_state_dict(got, strict=False)
    return base.eval()


def speculative_releases(source: Union[str, Path], cut: Union[int, Sequence[int]], defense: Optional[Defense],
                         prompts: Sequence[Sequence[int]], *, new_tokens: int = 16, draft: str = "free",
                         draft_tokens: int = 4, seed: int = 0):
    """Generate greedily from each prompt (token ids) over ``source`` split at ``cut`` with
    ``defense`` on what the client sends, with assisted decoding (``draft``: ``free`` — the
    U-shape client's own blocks, :func:`splitlearn.hf.draft.free_draft` —, or ``lookup``, prompt
    lookup; ``draft_tokens`` drafted per verify round, fixed), against a segment server of this
    process, and record what the server receives: a :class:`splitlearn.privacy.speculative.Releases`
    (every step's hidden states as sent, accepted or later rejected, with the tokens they encode),
    for :func:`~splitlearn.privacy.speculative.attack_releases` (docs/PRIVACY.md, 'Speculative
    decoding'). ``positions_sent`` is :class:`~splitlearn.hf.draft.CountingRemoteCache`'s count."""
    from ..hf.draft import CountingRemoteCache, LinkAwarePolicy, free_draft, link_aware
    from ..hf.modeling import SplitGPT2LMHeadModel
    from ..privacy.speculative import Releases
    from ..server.config import ServerConfig
    from ..server.http.app import create_app
    from ..transport.inproc import serve_inproc, unserve

    if draft not in ("free", "lookup"):
        raise ConfigError(f"draft is free or lookup, got {draft!r}")
    for name, v in (("new_tokens", new_tokens), ("draft_tokens", draft_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"speculative releases: {name} must be a positive integer, got {v!r}")
    cut = tuple(cut) if not isinstance(cut, int) else (cut,)
    if draft == "free" and len(cut) != 2:
        raise ConfigError("the free draft is the U-shape client's own blocks: a 2-way cut drafts by "
                          "prompt lookup (draft='lookup')")

    class Capture(CountingRemoteCache):  # what the server receives, step by step
        def start(self, hidden, attention_mask=None, logits_to_keep: int = 1):
            steps.append((self._length, hidden.detach()[0].float().clone()))
            return super().start(hidden, attention_mask, logits_to_keep)

    class Fixed(LinkAwarePolicy):  # every round drafts k: the releases do not depend on timing
        def next_length(self, k_min: int = 0) -> int:
            self.lengths.append(self.k_max)
            return self.k_max

    token = secrets.token_hex(16)
    cfg = ServerConfig(model=str(source), cuts=cut, seed=seed, tokens=(token,),
                       torch_threads=torch.get_num_threads())
    app = create_app(cfg)
    rt = app.extensions["splitlearn"]
    url = serve_inproc(app)
    rel = Releases(draft=draft, draft_tokens=draft_tokens)
    model = None
    try:
        model = SplitGPT2LMHeadModel.from_pretrained(str(source), server=url, token=token, seed=seed,
                                                     defense=defense, client_id="speculative-meter")
        model.eval()
        sent_ids = []
        hook = model.transformer.register_forward_pre_hook(
            lambda mod, args, kwargs: sent_ids.append((kwargs.get("input_ids") if kwargs.get("input_ids")
                                                       is not None else args[0]).detach()[0].clone()),
            with_kwargs=True)
        kw = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=model.config.eos_token_id or 0)
        if draft == "free":
            kw["assistant_model"] = free_draft(model)
        else:
            kw["prompt_lookup_num_tokens"] = draft_tokens
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed + 1000)  # the defense's noise draws
                for i, prompt in enumerate(prompts):
                    steps, sent_ids[:] = [], []
                    ids = torch.tensor([list(prompt)], dtype=torch.long)
                    remote = model.transformer.remote
                    with Capture.from_info(model.config, remote.transport, remote.info) as cache, \
                            link_aware(model, Fixed(k_max=draft_tokens)):
                        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                             **kw)
                    if len(sent_ids) != len(steps):
                        raise RuntimeError(f"{len(sent_ids)} forwards but {len(steps)} steps sent")
                    for (past, h), x in zip(steps, sent_ids):
                        if len(x) != len(h):
                            raise RuntimeError(f"a step sent {len(h)} positions for {len(x)} tokens")
                        rel.steps.append((i, past, h, x))
                    rel.outputs.append(out[0].clone())
                    rel.prompt_lengths.append(ids.shape[1])
                    rel.positions_sent += cache.positions_sent
        finally:
            hook.remove()
    finally:
        if model is not None:
            model.remote.close()
        unserve(url)
        rt.compute.close()
    return rel


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m splitlearn.privacy``: :func:`splitlearn.privacy.cli.main` with the fine-tuning."""
    from ..privacy.cli import main as meter_main

    return meter_main(argv, finetune=finetune_defense, speculate=speculative_releases)
