"""The split model classes check before they send (issue 51, item 6; splitlearn/hf/limits.py):
rows past the server's ``--max-batch`` and positions past the model's.

In-process servers started with ``--max-batch 3`` (tests/serverproc.py's InprocServerProcess)
holding the seeded init of models/tiny-varied.json (its outputs vary), one per shape, and a tiny
Llama (tests/families.py) for the other families' classes. The unsplit reference is the same
seeded model. Every request that reaches the server is counted (a WSGI wrapper on its app):
an evaluation of 7 rows is 3 requests of at most 3 rows and equals one batch; generate() of
more rows than 3 equals one batch's greedy (and beam) tokens, the groups padded alike (where
the output cannot be one batch's: a ConfigError); a
sequence past the model's 64 positions and a training forward of 4 rows are ConfigErrors
and nothing reaches the server.
"""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoSplitModelForCausalLM, ConfigError, SplitGPT2LMHeadModel
from splitlearn.api import protocol as P
from splitlearn.model.arch import arch_of
from splitlearn.model.segments import positions_from_mask

from conftest import VARIED
from serverproc import TOKEN, InprocServerProcess

LIMIT = 3  # the servers' --max-batch
NPOS = 64  # tiny-varied's n_positions, the families' max_position_embeddings
ATOL = 1e-5


class Requests:
    """Every request the app answers, as (method, path): a WSGI wrapper on the Flask app."""

    def __init__(self, app):
        self.seen: list[tuple[str, str]] = []
        self.inner, app.wsgi_app = app.wsgi_app, self

    def __call__(self, environ, start_response):
        self.seen.append((environ["REQUEST_METHOD"], environ["PATH_INFO"]))
        return self.inner(environ, start_response)

    def count(self, path=None) -> int:
        return sum(1 for _, p in self.seen if path is None or p == path)


def _serve(cuts, model):
    srv = InprocServerProcess(cuts, model=model, extra=["--max-batch", str(LIMIT)]).start()
    srv.requests = Requests(srv.app)
    return srv


@pytest.fixture(scope="module", params=[(1, 3), (2,)], ids=["u", "2way"])
def split_lm(request):
    srv = _serve(request.param, VARIED)
    model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=srv.url, token=TOKEN)
    model.overlap = False  # one session per generate call: the counts below are the groups'
    model.requests = srv.requests
    yield model
    model.remote.close()
    srv.stop()


def prompts(rows: int, T: int = 10, seed: int = 0):
    """(input_ids, attention_mask): every other row left-padded by 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, T), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, :3] = 0
    return ids.masked_fill(mask == 0, 256), mask


def test_an_evaluation_of_more_rows_than_the_server_takes_equals_one_batch(split_lm, varied_model):
    ids, mask = prompts(7)
    labels = ids.masked_fill(mask == 0, -100)
    pos = positions_from_mask(mask, ids.shape[1])
    before = split_lm.requests.count(P.FORWARD)
    with torch.no_grad():
        got = split_lm(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        want = varied_model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    assert split_lm.requests.count(P.FORWARD) - before == math.ceil(7 / LIMIT)  # 3 + 3 + 1 rows
    assert got.logits.shape == want.logits.shape == (7, 10, 257)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=ATOL, rtol=1e-5)
    assert want.logits[:, -1].argmax(-1).unique().numel() > 1  # rows differ: a mixed-up group would show


def test_generate_of_more_rows_than_the_server_takes_equals_one_batch(split_lm, varied_model):
    ids, mask = prompts(4)  # groups: prompts 0-2, prompt 3
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    free = varied_model.generate(**kw, eos_token_id=None, pad_token_id=0)
    eos = int(free[3, ids.shape[1]])  # prompt 3's first token: its group ends after one step
    assert any(int(free[r, ids.shape[1]]) != eos for r in range(3))  # the first group runs on
    before = split_lm.requests.count(P.SESSIONS)
    want = varied_model.generate(**kw, eos_token_id=eos)  # pad: the eos (transformers' fallback)
    got = split_lm.generate(**kw, eos_token_id=eos)
    assert split_lm.requests.count(P.SESSIONS) - before == 2  # one session per group
    assert torch.equal(got, want)
    assert want.shape[1] > ids.shape[1] + 1 and (want[3, ids.shape[1] + 1:] == eos).all()  # padded alike
    assert len(set(want[:3, ids.shape[1]:].flatten().tolist())) > 1


def test_beam_search_counts_each_prompts_beams_against_the_limit(split_lm, varied_model):
    ids, mask = prompts(3)  # 3 prompts x 2 beams = 6 rows: three calls of one prompt (2 rows)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=2, num_return_sequences=2,
              do_sample=False, eos_token_id=None, pad_token_id=0)
    before = split_lm.requests.count(P.SESSIONS)
    got = split_lm.generate(**kw)
    assert split_lm.requests.count(P.SESSIONS) - before == 3
    assert torch.equal(got, varied_model.generate(**kw))
    seen = len(split_lm.requests.seen)
    with pytest.raises(ConfigError, match=r"num_beams.*at most 3"):
        split_lm.generate(**dict(kw, num_beams=4, num_return_sequences=1))  # one prompt alone is 4 rows
    with pytest.raises(ConfigError, match="return_dict_in_generate"):
        split_lm.generate(**kw, return_dict_in_generate=True)
    with split_lm.new_cache() as cache, pytest.raises(ConfigError, match="with cache=.*at most 1 prompts"):
        split_lm.generate(**kw, cache=cache)  # one session cannot hold 6 rows
    assert len(split_lm.requests.seen) == seen


def test_a_sequence_past_the_models_positions_is_refused_before_anything_is_sent(split_lm):
    seen = len(split_lm.requests.seen)
    long = torch.randint(0, 256, (2, NPOS + 1))
    with torch.no_grad(), pytest.raises(ConfigError, match=f"65 positions passes the model's {NPOS}"):
        split_lm(input_ids=long)
    split_lm.train()
    try:
        with pytest.raises(ConfigError, match=f"model's {NPOS} positions"):
            split_lm(input_ids=long, labels=long)  # training: the forward never reaches wpe's IndexError
    finally:
        split_lm.eval()
    with torch.no_grad(), pytest.raises(ConfigError, match=f"position_ids reach {NPOS}"):
        split_lm(input_ids=long[:, :4], position_ids=torch.arange(NPOS - 3, NPOS + 1)[None])
    ids, mask = prompts(2, T=60)
    with pytest.raises(ConfigError, match=f"60 tokens \\+ max_new_tokens=5 passes the model's {NPOS}"):
        split_lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    assert len(split_lm.requests.seen) == seen  # nothing reached the server


def test_a_training_forward_of_more_rows_than_the_server_takes_is_refused_before_it_is_sent(split_lm):
    ids, _ = prompts(LIMIT + 1)
    seen = len(split_lm.requests.seen)
    split_lm.train()
    try:
        with pytest.raises(ConfigError, match=f"training forward of 4 rows passes the server's {LIMIT} rows"):
            split_lm(input_ids=ids, labels=ids)
    finally:
        split_lm.zero_grad()
        split_lm.eval()
    assert len(split_lm.requests.seen) == seen
    assert split_lm.remote.pieces == 0


def test_the_other_families_classes_split_and_check_alike(tmp_path):
    """A tiny Llama through AutoSplitModelForCausalLM (SplitDecoder, SplitFamilyMixin): the same
    evaluation, generation and positions as the GPT-2 classes."""
    fam.model("llama-gqa").save_pretrained(tmp_path / "model")
    srv = _serve((1, 3), str(tmp_path / "model"))
    model = AutoSplitModelForCausalLM.from_pretrained(str(tmp_path / "model"), server=srv.url, token=TOKEN)
    try:
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
        ids, mask = fam.padded(batch=5)
        pos = arch_of(ref.config).positions(mask, 0, ids.shape[1])
        before = srv.requests.count(P.FORWARD)
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask)
            want = ref(input_ids=ids, attention_mask=mask, position_ids=pos)
        assert srv.requests.count(P.FORWARD) - before == 2
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=1e-5)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                  pad_token_id=fam.PAD)
        assert torch.equal(model.generate(**kw), ref.generate(**kw))
        seen = len(srv.requests.seen)
        with torch.no_grad(), pytest.raises(ConfigError, match=f"model's {NPOS} positions"):
            model(input_ids=torch.randint(3, fam.V, (1, NPOS + 1)))
        assert len(srv.requests.seen) == seen
    finally:
        model.remote.close()
        srv.stop()
