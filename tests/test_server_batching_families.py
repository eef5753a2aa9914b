"""Cross-session decode batching of other families (docs/MODELS.md): the sessions' rows share one
pass through the layers' own call (splitlearn/server/engine/batching.py, ``family_decode``), each
session's attention on its own cache, and every session gets what it gets alone, within GPT-2's
batching tolerance (tests/test_server_batching.py): Llama with grouped KV heads, Gemma 2 with
alternating sliding layers (window 4, decoded past it) and both softcaps, and the other families
that batch. A session of huge finite values batched beside the others changes none of their rows."""
import threading
import time

import pytest
import torch

import families as fam
from splitlearn import partition
from splitlearn.server.engine import batching
from splitlearn.server.engine.batching import DecodeBatcher, DecodeItem, batched_decode
from splitlearn.server.engine.compute import ComputeThread

# rows per session, prompt length, left padding of its first row (0: no mask)
SESSIONS = [(1, 2, 0), (2, 7, 3), (1, 5, 0), (3, 3, 1)]
TOL = dict(atol=1e-6, rtol=1e-5)  # GPT-2's batching tolerance (tests/test_server_batching.py)


def close(o, e, factor=1.0):
    """GPT-2's tolerance, its atol scaled to the outputs' size: these models (initializer_range
    0.3) answer up to ~12 where GPT-2's tiny trunk answers ~2.6; the differences are float32
    rounding of the shared products over more rows (measured: at most 1.7e-6 of max|e|, the same
    with every session of one length: not the padded keys)."""
    torch.testing.assert_close(o, e, atol=factor * TOL["atol"] * max(1.0, float(e.abs().max())),
                               rtol=factor * TOL["rtol"])


@pytest.fixture(scope="module", params=["llama-gqa", "gemma2"])
def family(request):
    return request.param, fam.model(request.param)


def _segment(model, cuts):
    parts = partition(model, cuts)
    return (parts.trunk if parts.u_shape else parts.top).eval()


def _mask(rows, length, pad):
    if not pad:
        return None
    m = torch.ones(rows, length, dtype=torch.long)
    m[0, :pad] = 0
    return m


def _prefilled(seg, g, sessions=SESSIONS):
    """Two independent copies of each session's cache after its prefill, and its masks."""
    d = seg.config.hidden_size
    prompts = [(torch.randn(r, t, d, generator=g), _mask(r, t, p)) for r, t, p in sessions]
    copies = []
    for _ in range(2):
        caches = []
        for h, m in prompts:
            c = seg.new_cache()
            with torch.no_grad():
                seg(h, m, c)
            caches.append(c)
        copies.append(caches)
    return copies, [m for _, m in prompts]


def _grow(masks):
    return [None if m is None else torch.cat([m, torch.ones(m.shape[0], 1, dtype=torch.long)], 1) for m in masks]


def _batched(seg, new, masks, caches):
    return batched_decode(seg, [DecodeItem(c, x, mask=m) for x, m, c in zip(new, masks, caches)])


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["U-trunk", "2-way-top"])
def test_batched_decode_equals_each_session_alone(family, cuts, monkeypatch):
    name, model = family
    seg = _segment(model, cuts)
    assert batching.rows_batchable(seg)
    calls = []
    real = batching.family_decode
    monkeypatch.setattr(batching, "family_decode", lambda s, items: calls.append(len(items)) or real(s, items))
    g = torch.Generator().manual_seed(0)
    (ref, bat), masks = _prefilled(seg, g)
    d = seg.config.hidden_size
    for _ in range(6):  # past Gemma 2's window of 4 for every session
        new = [torch.randn(r, 1, d, generator=g) for r, _, _ in SESSIONS]
        masks = _grow(masks)
        with torch.no_grad():
            expected = [seg(x, m, c) for x, m, c in zip(new, masks, ref)]
        got = _batched(seg, new, masks, bat)
        for e, o in zip(expected, got):
            assert o.shape == e.shape
            close(o, e)
    assert calls == [len(SESSIONS)] * 6  # one shared pass a step, not one per session
    assert [c.length for c in bat] == [c.length for c in ref]
    for a, b in zip(ref, bat):  # every session's own cache holds what it holds alone
        for la, lb in zip(a.layers, b.layers):
            if getattr(la, "keys", None) is not None and la.keys is not None and la.keys.numel():
                close(lb.keys, la.keys)
                close(lb.values, la.values)


@pytest.mark.parametrize("name", ["llama-mha", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "phi3",
                                  "gpt_neox", "opt", "falcon"])
def test_every_family_that_batches_equals_each_session_alone(name):
    seg = _segment(fam.model(name), (1, 3))
    assert batching.rows_batchable(seg)
    g = torch.Generator().manual_seed(1)
    (ref, bat), masks = _prefilled(seg, g)
    d = seg.config.hidden_size
    for _ in range(5):
        new = [torch.randn(r, 1, d, generator=g) for r, _, _ in SESSIONS]
        masks = _grow(masks)
        with torch.no_grad():
            expected = [seg(x, m, c) for x, m, c in zip(new, masks, ref)]
        for e, o in zip(expected, _batched(seg, new, masks, bat)):
            close(o, e, factor=10)  # Gemma's rounding grows to 2e-6 of max|e| in 2 layers; a wrong key: O(1)


def test_falcons_alibi_runs_each_session_alone():
    seg = _segment(fam.model("falcon-alibi"), (1, 3))
    assert not batching.rows_batchable(seg)
    g = torch.Generator().manual_seed(2)
    (ref, bat), masks = _prefilled(seg, g)
    new = [torch.randn(r, 1, seg.config.hidden_size, generator=g) for r, _, _ in SESSIONS]
    masks = _grow(masks)
    with torch.no_grad():
        expected = [seg(x, m, c) for x, m, c in zip(new, masks, ref)]
    assert all(torch.equal(o, e) for o, e in zip(_batched(seg, new, masks, bat), expected))


@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_a_hostile_sessions_huge_values_change_no_other_sessions_rows(name):
    """Rows of 3e38 (finite: the decoder accepts them) batched beside three honest sessions: the
    honest rows are bit for bit what they are beside an honest fourth session of the same shape,
    and within the tolerance of each session alone; the hostile session's cache is its own."""
    seg = _segment(fam.model(name), (1, 3))
    d = seg.config.hidden_size
    g = torch.Generator().manual_seed(3)
    (beside_honest, beside_hostile), masks = _prefilled(seg, g)
    (alone, _), _ = _prefilled(seg, torch.Generator().manual_seed(3))
    for step in range(3):
        new = [torch.randn(r, 1, d, generator=g) for r, _, _ in SESSIONS]
        masks = _grow(masks)
        hostile = list(new)
        hostile[1] = torch.full_like(new[1], 3e38 if step % 2 == 0 else -3e38)
        a = _batched(seg, new, masks, beside_honest)
        b = _batched(seg, hostile, masks, beside_hostile)
        with torch.no_grad():
            solo = [seg(x, m, c) for x, m, c in zip(new, masks, alone)]
        for i in (0, 2, 3):
            assert torch.isfinite(b[i]).all()
            assert torch.equal(a[i], b[i])
            close(b[i], solo[i])
    for i in (0, 2, 3):  # the honest sessions' caches are untouched by the hostile rows
        for la, lb in zip(beside_honest[i].layers, beside_hostile[i].layers):
            if getattr(la, "keys", None) is not None and la.keys is not None and la.keys.numel():
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_concurrent_llama_sessions_share_one_forward():
    seg = _segment(fam.model("llama-gqa"), (1, 3))
    d = seg.config.hidden_size
    g = torch.Generator().manual_seed(4)
    sessions = [(1, 4, 0)] * 4
    (ref, bat), _ = _prefilled(seg, g, sessions)
    new = [torch.randn(1, 1, d, generator=g) for _ in sessions]
    compute = ComputeThread()
    batcher = DecodeBatcher(seg, compute)
    busy = threading.Event()
    compute.submit(busy.wait, 10)  # the model is busy: all four steps queue up behind it
    futures = [batcher.enqueue(DecodeItem(c, x, key=i)) for i, (c, x) in enumerate(zip(bat, new))]
    deadline = time.monotonic() + 10
    while len(batcher._queue) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    busy.set()
    outs = [f.result(10) for f in futures]
    compute.close()
    assert batcher.batches == 1 and batcher.items == 4
    with torch.no_grad():
        for o, x, c in zip(outs, new, ref):
            close(o, seg(x, None, c))


@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_four_concurrent_sessions_through_a_server_share_each_pass_and_decode_as_generate(name, tmp_path,
                                                                                          monkeypatch):
    """A 2-way server of the saved model (two tenants: alice's and mallory's sessions batched
    together), four sessions of 2 left-padded rows with prompts of 5-8 (past Gemma 2's window of 4):
    each decode step of the four, posted from four threads at once, is one pass of the server's
    batcher, and every session's logits are generate()'s within the server's decode tolerance
    (1e-5, tests/test_server_families.py) and its greedy tokens generate()'s."""
    from transformers import AutoModelForCausalLM

    from serverproc import OTHER, TENANTS, TOKEN, post_tensors, tensors_of
    from splitlearn.api import protocol as P
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.http.app import create_app

    passes = []
    real = batching.family_decode
    monkeypatch.setattr(batching, "family_decode", lambda seg, items: passes.append(len(items)) or real(seg, items))
    fam.model(name).save_pretrained(tmp_path)
    app = create_app(ServerConfig(model=str(tmp_path), cuts=(2,), tokens=TENANTS))
    rt = app.extensions["splitlearn"]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    bottom = partition(ref, (2,)).bottom
    steps, n = 4, 4
    sess = []
    for i in range(n):
        ids, mask = fam.padded(batch=2, length=5 + i, pad=1 + i % 3, seed=i)
        g = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=fam.PAD)
        token = TOKEN if i % 2 == 0 else OTHER
        client = app.test_client()
        r = client.post(P.SESSIONS, json={"rows": 2}, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201, r.get_data(as_text=True)
        sess.append(dict(ids=ids, mask=mask, g=g, token=token, client=client, sid=r.get_json()["session_id"],
                         cache=bottom.new_cache(), x=ids, m=mask, position=0, toks=[]))

    def post(s, step):
        full = s["mask"] if step == 0 else torch.cat([s["mask"], torch.ones(2, step, dtype=torch.long)], 1)
        with torch.no_grad():
            h = bottom(s["x"], full, s["cache"])
        s["resp"] = post_tensors(s["client"], P.SESSION_STEP.format(session_id=s["sid"]), {P.HIDDEN: h, P.MASK: s["m"]},
                                 P.SessionStepMeta(s["position"]).to_meta(), token=s["token"])
        s["position"] += h.shape[1]

    for step in range(steps):
        before = (rt.batcher.batches, rt.batcher.items)
        if step == 0:
            for s in sess:  # prefills run at once, one by one
                post(s, 0)
        else:
            busy = threading.Event()
            rt.compute.submit(busy.wait, 30)  # the model is busy: the four steps queue behind it
            threads = [threading.Thread(target=post, args=(s, step)) for s in sess]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while len(rt.batcher._queue) < n and time.monotonic() < deadline:
                time.sleep(0.01)
            busy.set()
            for t in threads:
                t.join(30)
            assert (rt.batcher.batches - before[0], rt.batcher.items - before[1]) == (1, n)
            assert passes[-1:] == [n]  # one shared pass through the layers, not one per session
        for s in sess:
            logits = tensors_of(s["resp"])[P.LOGITS]  # (2, V)
            assert torch.allclose(logits, s["g"].logits[step], rtol=0, atol=1e-5), (step, name)
            s["x"] = logits.clone().index_fill_(-1, torch.tensor([2]), -float("inf")).argmax(-1, keepdim=True)
            s["toks"].append(s["x"])
            s["m"] = torch.ones(2, 1, dtype=torch.long)
    for s in sess:
        assert torch.equal(torch.cat(s["toks"], 1), s["g"].sequences[:, s["ids"].shape[1]:])
    assert passes == [n] * (steps - 1)


def test_mixed_lora_adapters_batched_equal_each_session_alone():
    """A LoRA server's sessions of different clients' adapters (and the base) batched on a Llama
    GQA trunk: each row gets its own adapter's delta (splitlearn.model.lora's per-row router), as
    alone; and the adapters matter (an adapted row differs from the base row on the same input)."""
    from splitlearn.model.lora import LoraRouter, LoraSpec, lora_scope

    seg = _segment(fam.model("llama-gqa"), (1, 3))
    router = LoraRouter(seg, LoraSpec(r=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj")))
    adapters = []
    for seed in (1, 2):
        ad = router.new_adapter(0, f"c{seed}")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for b in ad.lora_B:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        adapters.append(ad)
    adapters = [adapters[0], None, adapters[1], adapters[0]]
    d = seg.config.hidden_size
    g = torch.Generator().manual_seed(5)
    caches = [[seg.new_cache() for _ in SESSIONS] for _ in range(2)]
    prompts = [(torch.randn(r, t, d, generator=g), _mask(r, t, p)) for r, t, p in SESSIONS]
    with torch.no_grad():
        for copy_ in caches:
            for c, (h, m), ad in zip(copy_, prompts, adapters):
                with lora_scope(seg, ad):
                    seg(h, m, c)
    masks = [m for _, m in prompts]
    for _ in range(3):
        new = [torch.randn(r, 1, d, generator=g) for r, _, _ in SESSIONS]
        masks = _grow(masks)
        want = []
        with torch.no_grad():
            for x, m, c, ad in zip(new, masks, caches[0], adapters):
                with lora_scope(seg, ad):
                    want.append(seg(x, m, c))
        got = batched_decode(seg, [DecodeItem(c, x, mask=m, adapter=ad)
                                   for x, m, c, ad in zip(new, masks, caches[1], adapters)])
        for w, o in zip(want, got):
            close(o, w)
    x = torch.randn(1, 1, d, generator=g)
    a = [seg.new_cache() for _ in range(2)]
    with torch.no_grad():
        outs = batched_decode(seg, [DecodeItem(a[0], x, adapter=None), DecodeItem(a[1], x, adapter=adapters[0])])
    assert not torch.allclose(outs[0], outs[1])
