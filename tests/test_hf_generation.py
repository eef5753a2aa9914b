"""transformers' own ``generate()`` on a split GPT-2 (issue 20, item 4), against the server in this process
(tests/serverproc.py's InprocServerProcess: the same app, reached through the inproc:// transport).

One server per shape (U-shape cuts (1, 3), 2-way cut 2), never trained, so the server holds the
seeded init of models/tiny-varied.json (whose greedy tokens vary: a drifting cache shows):
the ``tiny_model`` fixture here is that unsplit reference. The wire is
float32, so every decoding strategy must give the unsplit model's tokens exactly. ``generate``
makes its own :class:`~splitlearn.hf.cache.RemoteCache` (nobody passes ``cache``) and
closes its server session when it returns: every test checks that the server holds no session
afterwards (``GET /v1/info``'s ``generation.sessions``).
"""
import pytest
import torch
from transformers import PreTrainedTokenizerFast, TextStreamer

import splitlearn
from splitlearn import get_tokenizer
from splitlearn.api import protocol as P
from splitlearn.hf import RemoteCache, SplitGPT2LMHeadModel

from conftest import VARIED
from serverproc import TOKEN, InprocServerProcess, auth, web

pytestmark = pytest.mark.slow

PAD = 256  # models/tiny.json's eos/pad token


@pytest.fixture(scope="module")
def tiny_model(varied_model):
    """The unsplit reference: the tiny-varied model the servers here hold."""
    return varied_model


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def server(request):
    with InprocServerProcess(request.param, model=VARIED) as srv:
        srv.u_shape = len(request.param) == 2
        yield srv


@pytest.fixture(scope="module")
def split_lm(server):
    model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=server.url, token=TOKEN)
    yield model
    model.remote.close()


def sessions(server) -> int:
    """Generation sessions the server holds now."""
    r = web.get(server.url + P.INFO, headers=auth(), timeout=10)
    r.raise_for_status()
    return r.json()["generation"]["sessions"]


@pytest.fixture
def no_leak(server):
    """The test must leave the server holding no generation session."""
    assert sessions(server) == 0
    yield
    assert sessions(server) == 0, "a generate() call left its session open on the server"


def both(split_lm, tiny_model, seed=0, **kw):
    """(split tokens, unsplit tokens) of the same generate() call, seeded alike."""
    torch.manual_seed(seed)
    want = tiny_model.generate(**kw)
    torch.manual_seed(seed)
    got = split_lm.generate(**kw)
    return got, want


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The Hugging Face tokenizer of the byte specs (splitlearn.get_tokenizer), built offline: it
    encodes as splitlearn's ByteTokenizer (byte b is token b, 256 is <|endoftext|>)."""
    return get_tokenizer(VARIED)


@pytest.mark.parametrize("kw", [dict(), dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2),
                                dict(num_beams=3), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5),
                                dict(repetition_penalty=1.5, no_repeat_ngram_size=2), dict(use_cache=False)],
                         ids=["greedy", "sample-nrs", "beam", "beam-nrs", "repetition", "no-cache"])
def test_generate_makes_its_cache_and_equals_the_unsplit_model(split_lm, tiny_model, padded_batch, no_leak, kw):
    ids, mask = padded_batch  # (3, 23), left-padded
    got, want = both(split_lm, tiny_model, input_ids=ids, attention_mask=mask, max_new_tokens=8,
                     pad_token_id=PAD, **{"do_sample": False, **kw})
    assert got.shape[0] == ids.shape[0] * kw.get("num_return_sequences", 1)
    assert torch.equal(got, want)


def test_batch_one_greedy_follows_the_unsplit_model_past_the_first_token(split_lm, tiny_model, no_leak):
    # transformers 5.24 renamed past_key_values to cache: a forward that kept the old name got
    # cache=None from generate and ran without the server's keys and values, right at the first
    # token and drifting after it, with no error and no padding involved
    ids = torch.tensor([[5, 77, 120, 33, 9, 200]])
    got, want = both(split_lm, tiny_model, input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    assert len(set(want[0, ids.shape[1]:].tolist())) >= 4, "the reference repeats itself: it cannot show a drift"
    assert torch.equal(got, want)


def test_stop_strings(split_lm, tiny_model, padded_batch, no_leak):
    tok = byte_tokenizer()
    enc = tok("Once upon a time", return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert torch.equal(ids, padded_batch[0][:1, -ids.shape[1]:])  # as splitlearn's ByteTokenizer
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=20, pad_token_id=PAD)
    torch.manual_seed(0)
    free = tiny_model.generate(**kw)[0, ids.shape[1]:].tolist()
    # the first two printable ASCII tokens in a row that sampling writes (after the first two)
    i = next(i for i in range(2, len(free) - 4) if all(32 < t < 127 for t in free[i:i + 2]))
    stop = tok.decode(free[i:i + 2])
    got, want = both(split_lm, tiny_model, seed=0, stop_strings=[stop], tokenizer=tok, **kw)
    assert torch.equal(got, want)
    assert got.shape[1] == ids.shape[1] + i + 2 and tok.decode(got[0]).endswith(stop)  # stopped there


def test_text_streamer(split_lm, tiny_model, padded_batch, no_leak):
    tok = byte_tokenizer()

    class Capture(TextStreamer):
        def __init__(self):
            super().__init__(tok, skip_prompt=True)
            self.text = ""

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

    ids, mask = padded_batch[0][2:], padded_batch[1][2:]  # "The cat sat on the mat."
    streamed = []
    for model in (split_lm, tiny_model):
        streamer = Capture()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                             pad_token_id=PAD, streamer=streamer)
        streamed.append((out, streamer.text))
    (got, got_text), (want, want_text) = streamed
    assert torch.equal(got, want)
    assert got_text == want_text == tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("how", ["prompt-lookup", "assistant"])
def test_assisted_decoding_crops_the_server_cache(split_lm, tiny_model, padded_batch, no_leak, how):
    """The target verifies every drafted position in one round trip (2-way: the server answers
    the logits of all of them), and rejected ones are cropped on the server."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # repeats: prompt lookup drafts from them
    if how == "assistant":
        ids = padded_batch[0][2:]
    kw = dict(prompt_lookup_num_tokens=3) if how == "prompt-lookup" else dict(assistant_model=tiny_model)
    want = tiny_model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    calls = split_lm.remote.stats.calls
    got = split_lm.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD, **kw)
    assert torch.equal(got, want)
    assert split_lm.remote.stats.calls - calls < 12  # several tokens per round trip


def test_a_split_assistant_of_a_split_model(server, split_lm, tiny_model, padded_batch, no_leak):
    """Both models split on one server: two sessions during the call, none after."""
    assistant = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=server.url, token=TOKEN)
    try:
        ids = padded_batch[0][:1]
        want = tiny_model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
        got = split_lm.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                                assistant_model=assistant)
        assert torch.equal(got, want)
    finally:
        assistant.remote.close()


def test_a_cache_passed_in_stays_open_until_closed(server, split_lm, tiny_model, padded_batch, no_leak):
    ids, mask = padded_batch
    want = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                               pad_token_id=PAD)
    with split_lm.new_cache() as cache:
        assert isinstance(cache, splitlearn.RemoteCache) and splitlearn.RemoteCache is RemoteCache
        out = split_lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                pad_token_id=PAD, cache=cache, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want) and out.cache is cache
        assert sessions(server) == 1 and cache.get_seq_length() == want.shape[1] - 1
    assert sessions(server) == 0


def test_the_session_is_closed_when_generate_fails(server, split_lm, padded_batch, no_leak):
    class Boom(TextStreamer):
        def __init__(self):
            super().__init__(byte_tokenizer())
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:  # the prompt, then two tokens
                assert sessions(server) == 1
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        split_lm.generate(input_ids=padded_batch[0][:1], max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                          streamer=Boom())


def test_a_lossy_wire_generates_and_closes(server, tiny_model, padded_batch, no_leak):
    model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=server.url, token=TOKEN, wire_dtype="bfloat16")
    try:
        ids, mask = padded_batch
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False,
                             pad_token_id=PAD)
        assert out.shape == (3, ids.shape[1] + 6) and int(out.max()) <= PAD
        assert torch.equal(out[:, :ids.shape[1]], ids)
    finally:
        model.remote.close()


# -- two row groups in flight (RemoteCache.row_groups) ----------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2),
                                dict(num_beams=3, num_return_sequences=2, length_penalty=0.5),
                                dict(repetition_penalty=1.5, no_repeat_ngram_size=2)],
                         ids=["greedy", "sample-nrs", "beam-nrs", "repetition"])
def test_row_groups_give_the_unsplit_models_tokens(split_lm, tiny_model, padded_batch, no_leak, monkeypatch, kw):
    """``overlap=True``: every strategy runs its rows as two groups, each on its own session and
    transport lane, with the unsplit model's tokens."""
    ids, mask = padded_batch  # 3 prompts: groups of 2 and 1 prompts (their beams or sequences)
    t = split_lm.remote.transport
    lanes, start = [], t.start_call
    monkeypatch.setattr(t, "start_call", lambda path, tensors, meta=None, lane=0:
                        lanes.append(lane) or start(path, tensors, meta, lane))
    monkeypatch.setattr(split_lm, "overlap", True)
    got, want = both(split_lm, tiny_model, input_ids=ids, attention_mask=mask, max_new_tokens=8,
                     pad_token_id=PAD, **{"do_sample": False, **kw})
    assert torch.equal(got, want)
    assert lanes[:2] == [0, 1] and lanes.count(0) == lanes.count(1) >= 1  # both groups, every step


def test_row_groups_follow_every_cache_operation(server, split_lm, tiny_model, padded_batch, no_leak):
    """A cache with row groups under reorders, repeats, crops and selections (applied group by
    group) gives the unsplit model's logits; a map that moves rows between groups is refused."""
    from transformers import DynamicCache

    from splitlearn.model.segments import positions_from_mask

    ids, mask = padded_batch
    dyn = DynamicCache(config=tiny_model.config)
    state = {"mask": mask[:, :0]}

    @torch.no_grad()
    def step(new):
        m = state["mask"] = torch.cat([state["mask"], torch.ones_like(new) if new is not ids else mask], dim=1)
        pos = positions_from_mask(m, new.shape[1])
        got = split_lm(input_ids=new, attention_mask=m, position_ids=pos, cache=cache, logits_to_keep=0).logits
        want = tiny_model(new, attention_mask=m, position_ids=pos, cache=dyn, use_cache=True).logits
        assert got.shape == want.shape and torch.allclose(got, want, atol=2e-5)
        assert cache.get_seq_length() == dyn.get_seq_length() == m.shape[1]
        return got[:, -1].argmax(-1)[:, None]  # (B, 1): the greedy choice

    def spans():
        return [(sl.start, sl.stop) for sl, _ in cache.groups]

    def rows(op, arg):
        getattr(cache, op)(arg)
        getattr(dyn, op)(arg)
        state["mask"] = state["mask"].repeat_interleave(arg, dim=0) if op == "batch_repeat_interleave" \
            else state["mask"][arg]

    tok = lambda n, seed: torch.randint(0, PAD, (n, 1), generator=torch.Generator().manual_seed(seed))  # noqa: E731
    NPOS = tiny_model.config.n_positions
    with split_lm.new_cache(overlap=True) as cache:
        step(ids)  # 3 rows: groups of 2 and 1
        assert spans() == [(0, 2), (2, 3)] and sessions(server) == 2 and cache.session_id is None
        # greedy: the first group's next step is sent ahead with its greedy choice; fed other
        # tokens, the forward takes it back (the server drops it with the next step)
        cache.greedy, cache.max_length = True, NPOS
        choice = step(tok(3, 5))
        assert cache._ahead is not None and torch.equal(cache._ahead[2], choice[:2])
        choice = step((choice + 1) % PAD)  # not the choice: taken back, the step runs as usual
        assert cache._ahead is not None
        step(choice)  # the choice: the step sent ahead is the first group's
        rows("reorder_cache", torch.tensor([1, 1, 2]))  # beam search: within each group
        assert cache._ahead is None and not cache.greedy  # taken back first; rows move: no more
        step(tok(3, 1))
        rows("batch_repeat_interleave", 2)
        assert spans() == [(0, 4), (4, 6)]
        step(tok(6, 2))
        cache.crop(-1)
        dyn.crop(-1)
        state["mask"] = state["mask"][:, :-1]
        step(tok(6, 3))
        with pytest.raises(ValueError, match="keeps each group's rows"):
            cache.reorder_cache(torch.tensor([4, 0, 1, 2, 3, 5]))
        rows("batch_select_indices", torch.tensor([0, 3]))  # the second group's rows all go
        assert spans() == [(0, 2)] and sessions(server) == 1
        step(tok(2, 4))
    assert cache.groups is None


def test_a_step_sent_ahead_that_generate_did_not_choose_is_taken_back(split_lm, tiny_model, padded_batch, no_leak,
                                                                      monkeypatch):
    """Greedy with row groups sends the first group's next step ahead on its argmax; a stopping
    criterion that ends row 0 early makes generate pad it instead: every such step is taken
    back (its position dropped on both sides) and the tokens are the unsplit model's."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids, mask = padded_batch
    T = ids.shape[1]

    class StopRow0(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[0] = input_ids.shape[1] >= T + 3
            return done

    t = split_lm.remote.transport
    lanes, start = [], t.start_call
    monkeypatch.setattr(t, "start_call", lambda path, tensors, meta=None, lane=0:
                        lanes.append(lane) or start(path, tensors, meta, lane))
    monkeypatch.setattr(split_lm, "overlap", True)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=PAD, pad_token_id=0)
    got = split_lm.generate(**kw, stopping_criteria=StoppingCriteriaList([StopRow0()]))
    want = tiny_model.generate(**kw, stopping_criteria=StoppingCriteriaList([StopRow0()]))
    assert torch.equal(got, want) and (got[0, T + 3:] == 0).all()
    assert lanes.count(0) > lanes.count(1)  # steps taken back and sent again


def test_a_cache_with_row_groups_passed_in_splits_between_prompts(server, split_lm, tiny_model, padded_batch,
                                                                  no_leak):
    """``new_cache(overlap=True)`` passed to beam search: the groups split between prompts
    (3 prompts x 3 beams: 6 and 3 rows), so every beam reorder stays in its group."""
    ids, mask = padded_batch
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=PAD)
    want = tiny_model.generate(**kw)
    with split_lm.new_cache(overlap=True) as cache:
        got = split_lm.generate(**kw, cache=cache)
        assert torch.equal(got, want)
        assert [(sl.start, sl.stop) for sl, _ in cache.groups] == [(0, 6), (6, 9)] and sessions(server) == 2
    assert sessions(server) == 0
