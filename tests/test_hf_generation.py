"""transformers' own ``generate()`` on a split GPT-2 (issue 20, item 4), against real server processes.

One server per shape (U-shape cuts (1, 3), 2-way cut 2), never trained, so the server holds the
seeded init of models/tiny-varied.json (whose greedy tokens vary: a drifting cache shows):
the ``tiny_model`` fixture here is that unsplit reference. The wire is
float32, so every decoding strategy must give the unsplit model's tokens exactly. ``generate``
makes its own :class:`~splitlearn.hf.cache.RemoteCache` (nobody passes ``cache``) and
closes its server session when it returns: every test checks that the server holds no session
afterwards (``GET /v1/info``'s ``generation.sessions``).
"""
import pytest
import requests
import torch
from transformers import PreTrainedTokenizerFast, TextStreamer

import splitlearn
from splitlearn import protocol as P
from splitlearn.hf import RemoteCache, SplitGPT2LMHeadModel

from conftest import VARIED
from serverproc import TOKEN, ServerProcess, auth

pytestmark = pytest.mark.slow

PAD = 256  # models/tiny.json's eos/pad token


@pytest.fixture(scope="module")
def tiny_model(varied_model):
    """The unsplit reference: the tiny-varied model the servers here hold."""
    return varied_model


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def server(request):
    with ServerProcess(request.param, model=VARIED) as srv:
        srv.u_shape = len(request.param) == 2
        yield srv


@pytest.fixture(scope="module")
def split_lm(server):
    model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=server.url, token=TOKEN)
    yield model
    model.remote.close()


def sessions(server) -> int:
    """Generation sessions the server holds now."""
    r = requests.get(server.url + P.INFO, headers=auth(), timeout=10)
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
    """A Hugging Face tokenizer built offline that encodes as splitlearn's ByteTokenizer (byte b
    is token b, 256 is <|endoftext|>): byte-level BPE with no merges, GPT-2's byte alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    vocab = {chars[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = PAD
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


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
