"""The free draft (splitlearn/hf/draft.py's ``free_draft``: the U-shape client's own layers, the
server's trunk skipped) on every family's split model, against an in-process server.

The draft must be a plain model of the family (its own class, so ``generate(assistant_model=)``
takes it) whose logits are those of a model of the kept layers built by hand, bit for bit: the
kept layers renumbered under the family's names, ``layer_types`` sliced (Gemma 2's cuts here
keep ``[sliding, sliding, full]``: the unsliced first three would be ``[sliding, full, sliding]``,
and a sliding layer past its window of 4 masks otherwise), the tied head, Gemma's embedding
scale and both softcaps carried over. Assisted decoding with it gives the split model's plain
greedy tokens (greedy assisted decoding is exact), the rejected positions dropped on both sides.
"""
import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM
from splitlearn.errors import ConfigError
from splitlearn.hf.draft import CountingRemoteCache, LinkAwarePolicy, distill_draft, free_draft, link_aware
from splitlearn.model.arch import arch_of

from serverproc import TENANTS, TOKEN, InprocServerProcess

CUTS = (1, 2)  # 4 layers: the client keeps [0, 2, 3]
KEEP = [0, 2, 3]
GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=fam.PAD)


def tiny(name):
    """The family's tiny model; Gemma's embeddings scaled down so its greedy tokens vary (with the
    tests' init, sqrt(d) x the tied embedding makes it repeat the last token)."""
    model = fam.model(name)
    if name.startswith("gemma"):
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.03)
    return model


@contextlib.contextmanager
def split(name, tmp_path, cuts=CUTS):
    """(the split model of ``name`` against a server holding ``cuts``, the unsplit model)."""
    tiny(name).save_pretrained(tmp_path / "model")
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(cuts, model=str(tmp_path / "model"), extra=["--token-file", str(tmp_path / "tokens")]) \
            as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(tmp_path / "model"), server=srv.url, token=TOKEN)
        try:
            yield model, AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
        finally:
            model.remote.close()


def kept_by_moving_modules(unsplit, keep):
    """The unsplit model with its layer list cut to ``keep`` (the modules themselves moved), its
    config saying so: the model of the kept layers, built without the draft's code."""
    arch = arch_of(unsplit.config)
    base = arch.base_of(unsplit)
    layers = getattr(base, arch.layers_name)
    setattr(base, arch.layers_name, torch.nn.ModuleList([layers[i] for i in keep]))
    unsplit.config.num_hidden_layers = len(keep)
    if getattr(unsplit.config, "layer_types", None) is not None:
        unsplit.config.layer_types = [unsplit.config.layer_types[i] for i in keep]
    return unsplit


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


# -- Llama (GQA) and Gemma 2 (sliding layers, softcaps, tied head): by hand, and assisted decoding --

def hand_built(name, unsplit):
    """The family's model of layers [0, 2, 3], its config and state dict written out by hand."""
    cls, kw = fam.CONFIGS[name]
    kw = dict(kw, num_hidden_layers=3)
    if name == "gemma2":
        kw["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]  # of layers 0, 2, 3
    model = AutoModelForCausalLM.from_config(cls(**kw)).eval()
    state = {}
    for k, v in unsplit.state_dict().items():
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers."):].split(".", 1)
            if int(i) in KEEP:
                state[f"model.layers.{KEEP.index(int(i))}.{rest}"] = v
        else:
            state[k] = v
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding's
    return model


@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_the_free_draft_is_the_kept_layers_and_drafts_exactly(name, tmp_path):
    ids, mask = fam.padded(batch=1, length=8, pad=3)  # left-padded
    with split(name, tmp_path) as (model, unsplit):
        draft = free_draft(model)
        assert type(draft) is type(unsplit) and not draft.training and draft.free_draft_of == CUTS
        assert draft.config.num_hidden_layers == 3 and len(draft.model.layers) == 3
        # the split model's own tensors (training it trains the draft): layer 2 is the draft's layer 1
        assert draft.model.layers[1].self_attn.q_proj.weight.data_ptr() == \
            model.model.layers[2].self_attn.q_proj.weight.data_ptr()
        assert draft.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        if name == "gemma2":
            assert draft.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
            assert draft.lm_head.weight is draft.model.embed_tokens.weight  # tied: one parameter
            assert draft.config.final_logit_softcapping == unsplit.config.final_logit_softcapping is not None
        want = logits(hand_built(name, unsplit), ids, mask)
        got = logits(draft, ids, mask)
        assert torch.equal(got, want), float((got - want).abs().max())
        # not the whole model's, nor the unsliced types' (the check can fail)
        assert not torch.allclose(got, logits(unsplit, ids, mask), atol=1e-3)
        if name == "gemma2":
            cls, kw = fam.CONFIGS[name]
            unsliced = AutoModelForCausalLM.from_config(cls(**dict(kw, num_hidden_layers=3))).eval()
            unsliced.load_state_dict(draft.state_dict())
            assert unsliced.config.layer_types != draft.config.layer_types
            assert not torch.allclose(logits(unsliced, ids, mask), got, atol=1e-3)

        want = model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
        assert torch.equal(want, unsplit.generate(input_ids=ids, attention_mask=mask, **GREEDY))
        assert len(set(want[0, ids.shape[1]:].tolist())) > 2  # the tokens vary
        remote = model.remote
        with CountingRemoteCache.from_info(model.config, remote.transport, remote.info) as cache, \
                link_aware(model, LinkAwarePolicy(k_max=4, rtt_ms=50)) as p:
            got = model.generate(input_ids=ids, attention_mask=mask, cache=cache, assistant_model=draft, **GREEDY)
            assert torch.equal(got, want), (got, want)
            assert p.rounds == cache.steps_sent and p.drafted > 0
            assert p.rejections > 0  # (an untrained early exit: most drafts rejected, cropped on both sides)
            assert cache.positions_sent == ids.shape[1] + p.drafted + p.rounds - 1
            assert cache.get_seq_length() == got.shape[1] - 1  # rejected positions dropped on both sides
        # and by default (no block): the plain transformers call, the link-aware length
        model.last_draft_policy = None
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, assistant_model=draft, **GREEDY), want)
        assert model.last_draft_policy.drafted > 0


def test_a_two_way_client_has_no_free_draft(tmp_path):
    with split("llama-gqa", tmp_path, cuts=(2,)) as (model, _):
        with pytest.raises(ConfigError, match="U-shape"):
            free_draft(model)


# -- every family: the draft builds, is the family's class, and its forward is the kept layers' --

@pytest.mark.parametrize("name", fam.NAMES)
def test_every_familys_free_draft_is_its_kept_layers(name, tmp_path):
    ids, mask = fam.padded(batch=2, length=8, pad=3)
    with split(name, tmp_path) as (model, unsplit):
        draft = free_draft(model)
        assert type(draft) is type(unsplit) and draft.config.num_hidden_layers == len(KEEP)
        assert all(not b.is_meta for b in draft.buffers()) and all(not p.is_meta for p in draft.parameters())
        arch = arch_of(draft.config)
        assert len(arch.parts(draft)["layers"]) == len(KEEP)
        if getattr(unsplit.config, "tie_word_embeddings", False):
            assert draft.get_output_embeddings().weight is draft.get_input_embeddings().weight
        got = logits(draft, ids, mask)
        want = logits(kept_by_moving_modules(unsplit, KEEP), ids, mask)
        assert torch.allclose(got, want, atol=1e-6, rtol=0), float((got - want).abs().max())


def test_distilling_a_familys_free_draft_leaves_the_split_model_alone(tmp_path):
    """distill_draft's default student is a copy of the family's free draft: trained against the
    split model over the wire it moves towards it; the split model's weights do not move."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, fam.V, (4, 12), generator=g) for _ in range(8)]
    with split("llama-gqa", tmp_path) as (model, unsplit):
        before = {k: v.clone() for k, v in model.state_dict().items()}

        def kl(draft, ids):
            with torch.no_grad():
                want = torch.log_softmax(unsplit(ids).logits, -1)
                got = torch.log_softmax(draft(ids).logits, -1)
            return float(torch.nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean())

        start = kl(free_draft(model), batches[0])
        draft = distill_draft(model, batches, lr=3e-3, progress=False)
        assert type(draft) is type(unsplit) and not draft.training
        assert kl(draft, batches[0]) < 0.7 * start  # measured: 1.38 -> 0.71
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
