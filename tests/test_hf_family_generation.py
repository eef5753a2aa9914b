"""Every generate() mode on any family's split class (``AutoSplitModelForCausalLM``): a tiny Llama
(GQA) and Gemma 2 (sliding layers, softcaps) against a real in-process server, U-shape and 2-way.
Beam search, row groups (greedy with the step sent ahead, sampling, beam search), assisted decoding
with a same-vocabulary family draft and prompt lookup (the link-aware length: the WAN speculative
path, docs/WAN.md) give the unsplit model's tokens; rejected drafts leave the server's session."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM
from splitlearn.hf import generation
from splitlearn.hf.draft import CountingRemoteCache, LinkAwarePolicy, link_aware

from serverproc import TENANTS, TOKEN, InprocServerProcess

GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=fam.PAD)


@pytest.fixture(scope="module", params=[("llama-gqa", (1, 3)), ("llama-gqa", (2,)), ("gemma2", (1, 3)),
                                        ("gemma2", (2,))], ids=["llama-u", "llama-2way", "gemma2-u", "gemma2-2way"])
def served(request, tmp_path_factory):
    name, cuts = request.param
    d = tmp_path_factory.mktemp(name)
    fam.model(name).save_pretrained(d / "model")
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(cuts, model=str(d / "model"), extra=["--token-file", str(d / "tokens")]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(d / "model"), server=srv.url, token=TOKEN)
        yield name, model, AutoModelForCausalLM.from_pretrained(d / "model").eval()
        model.remote.close()


def test_beam_search_equals_the_unsplit(served):
    name, model, ref = served
    ids, mask = fam.padded()
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=3, num_return_sequences=2, **GREEDY)
    want = ref.generate(**kw)
    assert torch.equal(model.generate(**kw), want)
    assert len(set(want[:, ids.shape[1]:].flatten().tolist())) > 1


@pytest.mark.parametrize("mode", ["greedy", "sampling", "beam"])
def test_row_groups_equal_the_unsplit(served, mode, monkeypatch):
    """Two row groups in flight (``model.overlap = True``: a server on other cores), each its own
    session; greedy sends the first group's next step ahead. The tokens are one batch's."""
    name, model, ref = served
    steps = []
    real = generation.grouped_forward
    monkeypatch.setattr(generation, "grouped_forward", lambda *a, **k: steps.append(1) or real(*a, **k))
    ahead = []
    from splitlearn.hf.cache import RemoteCache
    sent = RemoteCache.sent_ahead
    monkeypatch.setattr(RemoteCache, "sent_ahead", lambda self, *a: ahead.append(1) or sent(self, *a))
    ids, mask = fam.padded(batch=4)
    extra = {"greedy": {}, "sampling": dict(do_sample=True), "beam": dict(num_beams=2)}[mode]
    kw = dict(dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=fam.PAD), **extra)
    # (no min_new_tokens: a logits processor makes the choice other than the logits' argmax, and
    # greedy then sends nothing ahead)
    model.overlap = True
    try:
        torch.manual_seed(5)
        want = ref.generate(**kw)
        torch.manual_seed(5)
        got = model.generate(**kw)
    finally:
        model.overlap = None
    assert torch.equal(got, want)
    assert len(steps) == got.shape[1] - ids.shape[1] > 1  # every step ran in two groups
    assert bool(ahead) == (mode == "greedy")  # greedy sent steps ahead; a sampler's choice is not known


def counting_cache(model) -> CountingRemoteCache:
    remote = model.remote
    return CountingRemoteCache.from_info(model.config, remote.transport, remote.info)


@pytest.mark.parametrize("kind", ["same", "other", "lookup"])
def test_assisted_decoding_equals_greedy(served, kind):
    """A same-vocabulary family draft (the target's weights, or another seed's: rejections) and
    prompt lookup, at the link-aware length (a 50 ms link's policy): the
    unsplit greedy tokens; every drafted position was sent, the rejected ones dropped again."""
    name, model, ref = served
    ids, mask = fam.padded(batch=1)
    ids, mask = torch.cat([ids, ids[:, 2:]], 1), torch.ones(1, 2 * ids.shape[1] - 2, dtype=torch.long)  # repeats
    draft = {"same": dict(assistant_model=fam.model(name)),  # the target's weights (a copy)
             "other": dict(assistant_model=fam.model(name, seed=1)),
             "lookup": dict(prompt_lookup_num_tokens=3)}[kind]
    want = ref.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    with counting_cache(model) as cache, link_aware(model, LinkAwarePolicy(k_max=4, rtt_ms=50)) as p:
        got = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **GREEDY, **draft)
        assert torch.equal(got, want), (got, want)
        assert p.rounds == cache.steps_sent and p.drafted > 0
        assert cache.positions_sent == ids.shape[1] + p.drafted + p.rounds - 1
        assert cache.get_seq_length() == got.shape[1] - 1  # rejected positions dropped on both sides
    assert p.lengths[0] == p.k_max  # before any measurement the 50 ms prior asks for the longest draft


def test_plain_generate_drafts_at_the_link_aware_length(served):
    """By default (no schedule of the caller's) generate(assistant_model=...) drafts through the
    link-aware policy: docs/WAN.md's speculative path."""
    name, model, ref = served
    ids, mask = fam.padded(batch=1)
    want = ref.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    got = model.generate(input_ids=ids, attention_mask=mask, assistant_model=fam.model(name, seed=1), **GREEDY)
    assert torch.equal(got, want)
    policy = model.last_draft_policy
    assert policy is not None and policy.rounds > 0 and policy.drafted > 0
