"""Speculative decoding across the split (splitlearn/hf/draft.py) against the server in this process
(tests/serverproc.py's InprocServerProcess).

Every draft kind (prompt lookup, an assistant model, the U-shape's free draft), with
transformers' own draft length and with the link-aware one, must give exactly the unsplit
model's greedy tokens (float32 wire); rejected drafted positions must leave the server's
cache (the next step at those positions equals the unsplit model); and every position sent,
accepted or not, is counted. transformers' assisted decoding is batch-size-1 only
(``_assisted_decoding`` raises for batch_size > 1), so the batch cases are one left-padded row
and a check that two rows are refused as transformers refuses them.
"""
import pytest
import torch

from splitlearn import load_model
from splitlearn.errors import ConfigError
from splitlearn.model.data import lm_batches
from splitlearn.hf.draft import (DEFAULT_RTT_MS, CountingRemoteCache, LinkAwarePolicy, best_draft_length,
                                 default_policy, distill_draft, expected_tokens, free_draft, link_aware,
                                 measured_rtt_ms)

from conftest import VARIED
from serverproc import TOKEN, InprocServerProcess

pytestmark = pytest.mark.slow

NEW = 16
ATOL = 2e-5
GREEDY = dict(do_sample=False, pad_token_id=256, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def tiny_model(varied_model):
    """The unsplit reference: the tiny-varied model the servers here hold (its tokens vary)."""
    return varied_model


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def split_lm(request):
    from splitlearn.hf.modeling import SplitGPT2LMHeadModel

    with InprocServerProcess(request.param, model=VARIED) as srv:
        model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=srv.url, token=TOKEN)
        yield model
        model.transformer.remote.close()


@pytest.fixture(scope="module")
def other_draft():
    """A tiny model with other weights: it disagrees with the target most of the time."""
    return load_model(VARIED, seed=1)


@pytest.fixture(scope="module")
def same_draft():
    """The target's own weights (a copy: transformers' heuristic writes the assistant's config)."""
    return load_model(VARIED)


def counting_cache(model) -> CountingRemoteCache:
    remote = model.transformer.remote
    return CountingRemoteCache.from_info(model.config, remote.transport, remote.info)


def one_row(padded_batch, row=2):
    ids, mask = padded_batch
    return ids[row:row + 1], mask[row:row + 1]


def draft_kwargs(kind, split_lm, same_draft, other_draft):
    if kind == "lookup":
        return dict(prompt_lookup_num_tokens=4)
    if kind == "assistant":
        return dict(assistant_model=same_draft)
    if kind == "other":
        return dict(assistant_model=other_draft)
    if not split_lm.transformer.u_shape:
        pytest.skip("the free draft is the U-shape client's own blocks (2-way: no head on the client)")
    return dict(assistant_model=free_draft(split_lm))


@pytest.mark.parametrize("kind", ["lookup", "assistant", "other", "free"])
@pytest.mark.parametrize("row,policy", [(0, True), (2, False)], ids=["padded-link-aware", "full-hf-length"])
def test_speculative_greedy_equals_greedy(split_lm, tiny_model, same_draft, other_draft, padded_batch, kind, policy,
                                          row):
    ids, mask = one_row(padded_batch, row)
    if row == 0:
        assert mask[0, 0] == 0  # left-padded
    kw = draft_kwargs(kind, split_lm, same_draft, other_draft)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    with counting_cache(split_lm) as cache, \
            link_aware(split_lm, LinkAwarePolicy(k_max=6, rtt_ms=50), control=policy) as p:
        got = split_lm.generate(input_ids=ids, attention_mask=mask, cache=cache, **GREEDY, **kw)
    assert torch.equal(got, want), (got, want)
    assert p.rounds == cache.steps_sent
    # every position the server saw: the prompt, then each round's drafts and the last token
    assert cache.positions_sent == ids.shape[1] + p.drafted + p.rounds - 1
    assert cache.positions_sent >= got.shape[1] - 1
    if kind == "assistant":  # the target's weights: every draft accepted
        assert p.accepted == p.drafted
        if policy:  # before any measurement the 50 ms prior asks for the longest draft; later
            # lengths follow the measured (here loopback, maybe loaded) times: not asserted
            assert p.lengths[0] == p.k_max


def test_two_rows_are_refused_as_transformers_refuses_them(split_lm, tiny_model, same_draft, padded_batch):
    ids, mask = padded_batch
    with pytest.raises(ValueError, match="batch_size = 1"):
        tiny_model.generate(input_ids=ids[:2], attention_mask=mask[:2], assistant_model=same_draft, **GREEDY)
    with pytest.raises(ValueError, match="batch_size = 1"):
        split_lm.generate(input_ids=ids[:2], attention_mask=mask[:2], assistant_model=same_draft, **GREEDY)


def test_rejected_positions_leave_the_server_cache(split_lm, tiny_model, other_draft, padded_batch):
    """A draft that mostly disagrees: many positions are cropped. After generate, the session
    holds exactly the kept tokens: the next step (at a position that held rejected drafts)
    gives the unsplit model's logits of the whole sequence."""
    ids, mask = one_row(padded_batch, 0)
    with counting_cache(split_lm) as cache, link_aware(split_lm, LinkAwarePolicy(k_max=5, rtt_ms=100)) as p:
        seq = split_lm.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                assistant_model=other_draft, **GREEDY)
        assert p.rejections > 0 and p.accepted < p.drafted
        assert cache.get_seq_length() == seq.shape[1] - 1  # the last token is not fed yet
        assert cache.positions_sent > seq.shape[1] - 1  # rejected positions were sent too
        full_mask = torch.cat([mask, torch.ones(1, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        pos = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
        with torch.no_grad():
            got = split_lm(seq[:, -1:], cache=cache, attention_mask=full_mask, position_ids=pos).logits
            want = tiny_model(seq, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
        assert torch.allclose(got[:, -1], want[:, -1], atol=ATOL), float((got[:, -1] - want[:, -1]).abs().max())
        assert cache._server_length == seq.shape[1]  # the server's session: kept tokens only


def test_free_draft_is_the_clients_own_blocks(split_lm, tiny_model, padded_batch):
    if not split_lm.transformer.u_shape:
        with pytest.raises(ConfigError, match="U-shape"):
            free_draft(split_lm)
        return
    draft = free_draft(split_lm)
    c1, c2 = split_lm.transformer.cuts
    n = split_lm.config.n_layer
    assert draft.config.n_layer == c1 + n - c2
    # shared tensors, not copies: training the split model trains the draft
    assert draft.transformer.h[0].attn.c_attn.weight.data_ptr() == \
        split_lm.transformer.h[0].attn.c_attn.weight.data_ptr()
    assert draft.transformer.h[c1].mlp.c_fc.weight.data_ptr() == split_lm.transformer.h[c2].mlp.c_fc.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == split_lm.lm_head.weight.data_ptr()
    # its forward: the unsplit model's blocks minus the trunk
    ids, _ = one_row(padded_batch)
    with torch.no_grad():
        h = tiny_model.transformer.wte(ids) + tiny_model.transformer.wpe(torch.arange(ids.shape[1]))
        for i in list(range(c1)) + list(range(c2, n)):
            h = tiny_model.transformer.h[i](h)
            h = h[0] if isinstance(h, tuple) else h
        want = tiny_model.lm_head(tiny_model.transformer.ln_f(h))
        assert torch.allclose(draft(ids).logits, want, atol=1e-5)


def _kl_to(teacher, draft, ids) -> float:
    with torch.no_grad():
        want = torch.log_softmax(teacher(ids).logits, -1)
        got = torch.log_softmax(draft(ids).logits, -1)
        return float(torch.nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean())


def test_distill_draft_learns_the_split_model_and_leaves_it_alone(split_lm, tiny_model, padded_batch):
    """The free draft's copy, trained against the split model over the wire: closer to the whole
    model's distribution afterwards, the split model's own (client and server) weights unchanged,
    and speculative greedy with it still the plain greedy."""
    if not split_lm.transformer.u_shape:
        with pytest.raises(ConfigError, match="U-shape"):
            distill_draft(split_lm, [], steps=1)
        return
    before = {k: v.clone() for k, v in split_lm.state_dict().items()}
    ids = torch.tensor([list(range(5, 37)), list(range(40, 72))])  # (2, 32)
    start = _kl_to(tiny_model, free_draft(split_lm), ids)
    draft = distill_draft(split_lm, lm_batches(list(range(1, 250)) * 4, 4, 32, seed=0), steps=40, lr=3e-3,
                          progress=False)
    assert not draft.training and draft.generation_config.num_assistant_tokens_schedule is None  # no schedule:
    # the split model's plain generate(assistant_model=draft) drafts at the link-aware length
    assert _kl_to(tiny_model, draft, ids) < 0.7 * start
    after = split_lm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the client's blocks: a copy was trained
    with torch.no_grad():  # the server's trunk too: the split forward still equals the unsplit model
        assert torch.allclose(split_lm(ids).logits, tiny_model(ids).logits, atol=ATOL)
    row, mask = one_row(padded_batch, 2)
    want = tiny_model.generate(input_ids=row, attention_mask=mask, **GREEDY)
    split_lm.last_draft_policy = None
    with counting_cache(split_lm) as cache:
        got = split_lm.generate(input_ids=row, attention_mask=mask, cache=cache, assistant_model=draft,
                                **GREEDY)
    assert torch.equal(got, want)
    assert split_lm.last_draft_policy.rounds == cache.steps_sent
    with pytest.raises(ConfigError, match="steps"):
        distill_draft(split_lm, iter([ids]), progress=False)  # no length, no steps
    with pytest.raises(ConfigError, match="ran out"):
        distill_draft(split_lm, [ids], steps=2, progress=False)


def test_draft_length_formula():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # a long link drafts longer than loopback at the same acceptance and draft cost
    assert best_draft_length(0.8, 0.100, 0.002) > best_draft_length(0.8, 0.003, 0.002) >= 1
    assert best_draft_length(0.0, 0.1, 0.001) == 0  # nothing is ever accepted: no draft
    assert best_draft_length(0.0, 0.1, 0.001, k_min=1) == 1
    assert best_draft_length(0.3, 0.002, 0.002) == 0  # loopback, a draft as dear as the round: plain steps
    assert best_draft_length(1.0, 0.1, 0.0, k_max=9) == 9  # free and always right: the most allowed
    p = LinkAwarePolicy(k_max=8, rtt_ms=50, prior_weight=0)
    p.update(drafted=4, accepted=4, draft_s=0.004, verify_s=0.05)
    p.update(drafted=4, accepted=2, draft_s=0.004, verify_s=0.05)
    assert p.measured_acceptance == 0.75 and p.acceptance == pytest.approx(6 / 7)
    assert p.next_length() == best_draft_length(6 / 7, 0.05, 0.001, 8) > 0


# -- the default: a plain generate() drafts at the link-aware length (issue 33, item 5) -----------

@pytest.mark.parametrize("kind", ["lookup", "assistant", "free"])
def test_plain_generate_drafts_at_the_link_aware_length(split_lm, tiny_model, same_draft, other_draft,
                                                         padded_batch, kind):
    """No link_aware block, no schedule: the plain transformers call. Its tokens are the plain
    greedy ones, every server step is one round of the link-aware policy, which drafted the
    longest draft first (no draft cost measured yet) and assumed the client's measured round trip."""
    ids, mask = one_row(padded_batch, 0)
    kw = draft_kwargs(kind, split_lm, same_draft, other_draft)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    split_lm.last_draft_policy = None
    rtt = measured_rtt_ms(split_lm)
    with counting_cache(split_lm) as cache:
        got = split_lm.generate(input_ids=ids, attention_mask=mask, cache=cache, **GREEDY, **kw)
    assert torch.equal(got, want), (got, want)
    p = split_lm.last_draft_policy
    assert isinstance(p, LinkAwarePolicy)
    assert p.rtt_ms == (rtt if rtt is not None else DEFAULT_RTT_MS)
    assert p.rounds == cache.steps_sent == len(p.lengths) and p.lengths[0] == p.k_max
    assert cache.positions_sent == ids.shape[1] + p.drafted + p.rounds - 1
    if kind == "assistant":  # the target's weights: every draft accepted; the prompt and 15 drafted
        assert p.accepted == p.drafted == NEW - 1 and cache.steps_sent == 1  # tokens in one round trip


def test_a_schedule_of_the_callers_own_is_kept(split_lm, tiny_model, same_draft, padded_batch):
    """transformers' own schedule where the caller set one: no policy, transformers' lengths
    (the constant 20 with the assistant's confidence stop: more rounds than the policy's), the
    same tokens."""
    ids, mask = one_row(padded_batch, 2)
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    split_lm.last_draft_policy = None
    with counting_cache(split_lm) as cache:
        got = split_lm.generate(input_ids=ids, attention_mask=mask, cache=cache, assistant_model=same_draft,
                                num_assistant_tokens_schedule="constant", **GREEDY)
    assert torch.equal(got, want) and split_lm.last_draft_policy is None
    own_steps = cache.steps_sent
    with counting_cache(split_lm) as cache:
        assert torch.equal(split_lm.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                             assistant_model=same_draft, **GREEDY), want)
    assert split_lm.last_draft_policy is not None and cache.steps_sent < own_steps


class _Stats:
    def __init__(self, calls, round_trip_s):
        self.calls, self.round_trip_s = calls, round_trip_s


def _fake_split(calls=0, round_trip_s=0.0):
    from types import SimpleNamespace

    from transformers import GenerationConfig

    return SimpleNamespace(remote=SimpleNamespace(stats=_Stats(calls, round_trip_s)),
                           generation_config=GenerationConfig(), link_aware_drafts=True)


def test_default_policy_decides_who_chooses_the_length(same_draft):
    from transformers import GenerationConfig

    m = _fake_split()
    assert default_policy(m, (), dict(max_new_tokens=4)) is None  # no drafting
    assert default_policy(m, (), dict(prompt_lookup_num_tokens=4)).rtt_ms == DEFAULT_RTT_MS  # nothing measured
    m = _fake_split(calls=4, round_trip_s=0.2)
    assert default_policy(m, (), dict(assistant_model=same_draft)).rtt_ms == pytest.approx(50.0)  # the mean call
    for own in (dict(num_assistant_tokens=5), dict(num_assistant_tokens_schedule="heuristic"),
                dict(assistant_confidence_threshold=0.2),
                dict(generation_config=GenerationConfig(num_assistant_tokens=5))):
        assert default_policy(m, (), dict(assistant_model=same_draft, **own)) is None, own
    # a generation_config without a schedule (a pipeline passes one) leaves the default on
    assert default_policy(m, (), dict(assistant_model=same_draft, generation_config=GenerationConfig())) is not None
    assert default_policy(m, (None, GenerationConfig(num_assistant_tokens=3)), dict(prompt_lookup_num_tokens=2)) is None
    draft = load_model(VARIED)
    draft.generation_config.num_assistant_tokens = 7  # transformers 5.24 reads the schedule here
    assert default_policy(m, (), dict(assistant_model=draft)) is None
    m.generation_config.num_assistant_tokens_schedule = "heuristic"
    assert default_policy(m, (), dict(prompt_lookup_num_tokens=2)) is None
    m = _fake_split()
    m.link_aware_drafts = False
    assert default_policy(m, (), dict(prompt_lookup_num_tokens=2)) is None


def test_a_policy_carried_into_a_new_generation_drafts_its_first_round(split_lm, tiny_model, other_draft,
                                                                       padded_batch):
    """docs/WAN.md's ``with link_aware(...) as policy:`` around several ``generate`` calls: a policy
    that judged drafting not to pay (k = 0) began the next generation with a round of no draft,
    and the assistant's next round failed on its prompt-length attention mask (issue 54)."""
    ids, mask = one_row(padded_batch, 2)
    policy = LinkAwarePolicy(k_max=6, rtt_ms=0.001, rounds=3, token_s=1.0, round_s=1e-4, accepted=0,
                             rejections=50, drafted=50)
    assert policy.next_length() == 0 and policy.next_length(k_min=1) == 1  # drafting does not pay here
    policy.lengths.clear()
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    with link_aware(split_lm, policy) as p:
        got = split_lm.generate(input_ids=ids, attention_mask=mask, assistant_model=other_draft, **GREEDY)
    assert torch.equal(got, want)
    assert p.lengths[0] == 1 and 0 in p.lengths[1:]  # the first round drafted; later ones did not


def test_assisted_generation_draws_no_deprecation_warning(split_lm, tiny_model, other_draft, padded_batch):
    """transformers' assistant passes ``generation_config`` with ``max_new_tokens``... as keywords to
    its own ``generate``, which warns that this is deprecated; the link-aware draft folds them into
    the config (issue 54). The output stays greedy's."""
    import logging

    import transformers

    ids, mask = one_row(padded_batch, 2)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("transformers")
    transformers.logging.get_logger("x").warning_once.cache_clear()  # warning_once: once per process
    log.addHandler(handler)
    try:
        with link_aware(split_lm, LinkAwarePolicy(k_max=4, rtt_ms=50)):
            got = split_lm.generate(input_ids=ids, attention_mask=mask, assistant_model=other_draft, **GREEDY)
    finally:
        log.removeHandler(handler)
    assert torch.equal(got, tiny_model.generate(input_ids=ids, attention_mask=mask, **GREEDY))
    assert not [r for r in records if "generation_config" in r.getMessage()], [r.getMessage() for r in records]
