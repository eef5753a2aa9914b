"""Rolling back a sliding-window KV cache (issue 52: "the KV cache across steps and past a sliding
window's length"). A sliding layer (transformers' ``DynamicSlidingWindowLayer``) holds only its
window's last positions, so dropping rejected drafts is its own ``crop(-k)`` on the states it
recorded (``activate_past_recording``), as transformers' assisted decoding does, on the server's
session caches and on the client's layers. A Mistral (every layer sliding) at window 4 (the prompt
already past it) and 16 (crossed while decoding), U-shape and 2-way: assisted decoding with a
draft and prompt lookup give plain greedy's tokens and the unsplit model's, and what each
session's cache keeps alive stays within what the server reserved for it. The same on Gemma 3
(alternating sliding layers), Phi-3 and Qwen2 given a window."""
import pytest
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

import families as fam
from splitlearn import AutoSplitModelForCausalLM, partition
from splitlearn.api import protocol as P
from splitlearn.hf.cache import RemoteCache
from splitlearn.server.engine import budget as bm
from splitlearn.server.engine import sessions as sm

from serverproc import TENANTS, TOKEN, InprocServerProcess, assert_error, auth, post_tensors, tensors_of

GREEDY = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, pad_token_id=fam.PAD)


#: sliding families beside Mistral (every layer sliding): Gemma 3 (alternating; its own head, where
#: the tied one repeats the last token), Phi-3 and Qwen2 given a window (Qwen2's first layer full)
EXTRA = {"gemma3": dict(tie_word_embeddings=False), "phi3": {},
         "qwen2": dict(use_sliding_window=True, max_window_layers=1)}


def sliding(name: str, window: int, seed: int = 0):
    """A seeded random model of family ``name`` with a window of ``window``, in eval mode."""
    cls, kw = fam.CONFIGS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cls(**{**kw, **EXTRA.get(name, {}), "sliding_window": window})).eval()


def mistral(window: int, seed: int = 0):
    return sliding("mistral", window, seed)


def kept_bytes(cache) -> int:
    """Bytes of the storages ``cache``'s layers keep alive (a view keeps its whole storage)."""
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in cache.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)}
    return sum(kept.values())


@pytest.fixture(scope="module", params=[("mistral", 4, (1, 3)), ("mistral", 4, (2,)), ("mistral", 16, (1, 3)),
                                        ("mistral", 16, (2,)), ("gemma3", 4, (1, 3)), ("phi3", 4, (2,)),
                                        ("qwen2", 4, (1, 3))],
                ids=["w4-u", "w4-2way", "w16-u", "w16-2way", "gemma3-u", "phi3-2way", "qwen2-u"])
def served(request, tmp_path_factory):
    name, window, cuts = request.param
    d = tmp_path_factory.mktemp(f"{name}{window}")
    sliding(name, window).save_pretrained(d / "model")
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess(cuts, model=str(d / "model"), extra=["--token-file", str(d / "tokens")]) as srv:
        model = AutoSplitModelForCausalLM.from_pretrained(str(d / "model"), server=srv.url, token=TOKEN)
        yield name, window, model, AutoModelForCausalLM.from_pretrained(d / "model").eval()
        model.remote.close()


def test_assisted_decoding_past_the_window_equals_greedy(served, monkeypatch):
    """A draft of another seed (rejections) and prompt lookup; 12 prompt tokens and 14 new ones
    run past both windows. After every server step a session's cache keeps alive at most what its
    hold prices (``hold / SESSION_SLACK``); after every crop of the client's cache its sliding
    layers keep at most ``window - 1`` positions (``crop(0)`` shrinks them back, as in transformers)."""
    name, window, model, ref = served
    ids, _ = fam.padded(batch=1)
    ids = torch.cat([ids, ids[:, 2:]], 1)  # (1, 12): repeats, for prompt lookup
    mask = torch.ones_like(ids)
    over = []

    end = sm.Session.end

    def checked_end(self, answer, numbered):
        priced = self.hold.nbytes / bm.SESSION_SLACK
        if kept_bytes(self.cache) > priced + 1:
            over.append(("server", self.cache.length, kept_bytes(self.cache), priced))
        return end(self, answer, numbered)

    crop = RemoteCache.crop

    def checked_crop(self, n):
        crop(self, n)
        for layer in self.layers:
            if getattr(layer, "is_sliding", False) and layer.is_initialized \
                    and layer.keys.shape[-2] > window - 1:
                over.append(("client", layer.cumulative_length, layer.keys.shape[-2]))

    monkeypatch.setattr(sm.Session, "end", checked_end)
    monkeypatch.setattr(RemoteCache, "crop", checked_crop)
    want = ref.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    assert len(set(want[0, ids.shape[1]:].tolist())) > 1
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **GREEDY), want)
    for draft in (dict(assistant_model=sliding(name, window, seed=1)), dict(prompt_lookup_num_tokens=3)):
        got = model.generate(input_ids=ids, attention_mask=mask, **GREEDY, **draft)
        assert torch.equal(got, want), (draft.keys(), got, want)
    assert not over, over


def step(client, sid, h, position, n, crop=None):
    meta = P.SessionStepMeta(position, step=n, crop=crop).to_meta()
    return post_tensors(client, P.SESSION_STEP.format(session_id=sid), {P.HIDDEN: h}, meta)


@pytest.mark.parametrize("window", [4, 16])
def test_a_session_drops_drafts_past_the_window_exactly_and_refuses_what_it_no_longer_holds(window):
    """A Mistral trunk's session: a 20-position prefill (past both windows), a step of 3 drafts,
    then one that crops 2 of them: its answer is transformers' own rollback's (a local cache
    recording its past, ``crop(-2)``) and a fresh session's fed the kept positions (within 1e-4:
    the server's prepacked and batched products round apart; a wrong key is off by units). A crop deeper than the last step's positions (the window's earlier states are gone) is a
    400 that changes nothing: the next step, the right one, still matches."""
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.http.app import create_app
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mistral(window).save_pretrained(d)
        app = create_app(ServerConfig(model=d, cuts=(1, 3), tokens=TENANTS))
    client = app.test_client()
    h = torch.randn(1, 24, fam.D, generator=torch.Generator().manual_seed(0))  # (1, 24, d)

    def open_():
        r = client.post(P.SESSIONS, json={"rows": 1}, headers=auth(TOKEN))
        assert r.status_code == 201, r.get_data(as_text=True)
        return r.get_json()["session_id"]

    a, b = open_(), open_()
    tensors_of(step(client, a, h[:, :20], 0, 1))
    tensors_of(step(client, a, h[:, 20:23], 20, 2))  # 3 drafts
    assert_error(step(client, a, h[:, 21:22], 19, 3, crop=19), 400, "sliding")  # 4 back: gone
    got = tensors_of(step(client, a, h[:, 23:24], 21, 3, crop=21))[P.HIDDEN]  # keeps 1 of them
    ref = partition(mistral(window), (1, 3)).trunk
    with torch.no_grad():  # transformers' own rollback of the same steps (the server's products round apart)
        c = ref.new_cache()
        c.activate_past_recording()
        ref(h[:, :20], None, c)
        ref(h[:, 20:23], None, c)
        for layer in c.layers[1:3]:  # the trunk's (the model's other slots stay empty)
            layer.crop(-2)
        c.length = 21
        want = ref(h[:, 23:24], None, c)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    tensors_of(step(client, b, h[:, :21], 0, 1))  # the kept positions alone
    assert torch.allclose(got, tensors_of(step(client, b, h[:, 23:24], 21, 2))[P.HIDDEN], atol=1e-4, rtol=0)


class StopRow0(StoppingCriteria):
    """Row 0 stops at ``at`` positions: generate pads it from then on, where a step sent ahead
    fed it the argmax (taken back)."""

    def __init__(self, at: int):
        self.at = at

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[0] = input_ids.shape[1] >= self.at
        return done


def test_row_groups_take_back_a_step_sent_ahead_past_the_window(served, monkeypatch):
    """Greedy with two row groups (the first group's next step sent ahead, docs in hf/ahead.py),
    row 0 stopped early: the steps sent ahead for it are taken back, its client layers cropped
    past the window (they record their past) and the server's by the next step's crop; the
    tokens are the unsplit model's, and the first group's sliding layers keep at most the window
    (``window - 1`` plus the step in flight)."""
    name, window, model, ref = served
    takes, over = [], []
    back = RemoteCache.take_back

    def counted(self, step):
        takes.append(1)
        back(self, step)
        for layer in self.layers:
            if getattr(layer, "is_sliding", False) and layer.is_initialized and layer.keys.shape[-2] > window:
                over.append((layer.cumulative_length, layer.keys.shape[-2]))

    monkeypatch.setattr(RemoteCache, "take_back", counted)
    ids, mask = fam.padded(batch=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=fam.PAD,
              eos_token_id=fam.V - 1, stopping_criteria=StoppingCriteriaList([StopRow0(ids.shape[1] + 4)]))
    want = ref.generate(**kw)
    model.overlap = True
    try:
        got = model.generate(**kw)
    finally:
        model.overlap = None
    assert torch.equal(got, want)
    assert len(takes) > 1 and not over, (takes, over)
