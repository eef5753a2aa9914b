"""The memory model on other families (splitlearn/server/engine/layercost.py, budget.py): a Llama
with grouped KV heads (sdpa, gated MLP) and a Gemma 2 (eager attention with its softcap, four norms,
alternating sliding layers). Each price is an upper bound of what is measured on the CPU and
within 1.5x of it: what autograd keeps per layer, the peak of a forward and backward (the live
bytes of the storages the operators make, tests/tensorpeak.py), and the KV cache a session holds
past the sliding window."""
import pytest
import torch
import transformers as tf

import families as fam
from splitlearn import partition
from splitlearn.server.engine import budget as bm

from tensorpeak import TensorPeak

# GPT-2-like proportions, small: d 64, I 176 (Llama's 2.75d), 4 heads of 16, 2 KV heads
SHAPES = {
    "llama-gqa": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "gemma2": (tf.Gemma2Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                     attn_implementation="eager")),
}


def trunk(name, layers=3):
    cls, kw = SHAPES[name]
    c = cls(vocab_size=96, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
            max_position_embeddings=512, **kw)
    torch.manual_seed(0)
    return partition(tf.AutoModelForCausalLM.from_config(c), (1, layers)).trunk  # layers - 1 layers


def _mask(B, T, padded):
    if not padded:
        return None
    m = torch.ones(B, T, dtype=torch.long)
    m[0, : T // 2] = 0
    return m


def _saved_bytes(seg, B, T, padded):
    """Bytes autograd keeps for a training forward of ``seg`` (parameters and input excluded)."""
    params = {p.untyped_storage().data_ptr() for p in seg.parameters()}
    h = torch.randn(B, T, seg.config.hidden_size, requires_grad=True)
    seen = {}

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != h.untyped_storage().data_ptr():
            seen[s.data_ptr()] = s.nbytes()
        return t

    seg.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        seg(h, _mask(B, T, padded))
    return sum(seen.values())


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("B,T,padded", [(2, 32, False), (1, 64, True), (4, 48, False)])
def test_kept_per_layer_bounds_what_autograd_keeps(name, B, T, padded):
    seg = trunk(name)
    m = bm.Dims.of(seg, torch.float32)
    assert m.layer is not None and m.layer.gated and m.layer.kv == 2 * 16
    assert m.layer.norms == (4 if name == "gemma2" else 2)
    measured = _saved_bytes(seg, B, T, padded)
    predicted = m.blocks * bm.kept_per_block(m, B, T, T, padded)
    assert measured <= predicted <= 1.5 * measured, (measured, predicted)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("padded", [False, True])
def test_a_forward_and_backwards_peak_is_under_the_price_and_within_1_5x(name, padded):
    """The tensors a training forward and backward of the trunk make at their peak (live storages,
    parameters excluded) against the price of what the step computes: every layer's kept tensors,
    one layer's workspace, the parameters' gradients, the input, output and their gradients."""
    seg = trunk(name).train()
    B, T = 4, 64
    m = bm.Dims.of(seg, torch.float32)
    x = torch.randn(B, T, m.d)
    mask = _mask(B, T, padded)
    tp = TensorPeak()
    with tp:
        h = x.clone().requires_grad_()
        out = seg(h, mask)
        out.backward(torch.ones_like(out))
    measured = tp.peak
    e, N = m.elem, B * T
    predicted = (m.blocks * bm.kept_per_block(m, B, T, T, padded) + bm.block_workspace(m, B, T, T, padded, m.scores)
                 + m.grads + 4 * e * N * m.d)
    assert measured > 200 * 1024  # it really ran
    assert measured <= predicted <= 1.5 * measured, (measured, predicted, tp.at_peak)
    # a forward without gradients (/v1/forward's trunk): its output and one layer's temporaries
    seg.eval()
    tp = TensorPeak()
    with tp, torch.no_grad():
        seg(x, mask)
    predicted = e * N * m.d + bm.block_workspace(m, B, T, T, padded, m.eager)
    assert tp.peak <= predicted <= 1.5 * tp.peak, (tp.peak, predicted, tp.at_peak)


def test_kv_bytes_follow_kv_heads_and_a_sliding_layer_holds_its_window():
    """A session's price: 2 x KV heads x head_dim per layer and cached position; a Gemma 2 sliding
    layer's rows at most the window. A real session decoded past the window holds no more."""
    seg = partition(fam.model("gemma2"), (1, 4)).trunk.eval()  # layers 1-3: full, sliding, full
    assert seg.config.layer_types[1:4] == ["full_attention", "sliding_attention", "full_attention"]
    m = bm.Dims.of(seg, torch.float32)
    kv, hd, window = 2, 8, 4
    assert m.kv_token == 3 * 2 * kv * hd * 4 and m.kv_sliding == 1 * 2 * kv * hd * 4 and m.window == window
    rows, length = 2, 11
    priced = bm.kv_bytes(m, rows * length, rows)
    assert priced == rows * length * 2 * 2 * kv * hd * 4 + rows * window * 2 * kv * hd * 4
    assert bm.kv_bytes(m, rows * length) == rows * length * m.kv_token  # rows unknown: as full (a bound)
    cache = seg.new_cache()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        seg(torch.randn(rows, 5, 32, generator=g), None, cache)
        for _ in range(length - 5):
            seg(torch.randn(rows, 1, 32, generator=g), None, cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
    assert held <= priced and priced <= 1.5 * held, (held, priced)
    llama = bm.Dims.of(partition(fam.model("llama-gqa"), (1, 3)).trunk, torch.float32)
    assert bm.kv_bytes(llama, 100) == 100 * 2 * 2 * (2 * 8) * 4  # 2 layers, 2 KV heads of 8: half of 2·d


@pytest.mark.parametrize("name", ["gemma2", "mistral", "gpt2"])
def test_a_sessions_reservation_is_its_cache_as_the_family_prices_it(name, tmp_path):
    """What a session reserves as its cache grows past the window (window 4: a 7-token prefill,
    2 decode steps) covers the storages its cache keeps alive, and after a decode step is its KV
    cache as ``Arch.kv_bytes`` prices it (a sliding layer's rows at most the window) times the
    session slack. Right after a prefill a sliding layer keeps all of it (transformers keeps its
    last ``window - 1`` as a view of the step's concatenation), and so is priced. GPT-2's is
    2·L·tokens·d as before."""
    from splitlearn.api import protocol as P
    from splitlearn.model.arch import SLIDING
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.http.app import create_app

    from serverproc import TENANTS, TOKEN, auth, post_tensors, segment_of

    fam.model(name).save_pretrained(tmp_path)
    app = create_app(ServerConfig(model=str(tmp_path), cuts=(1, 4), tokens=TENANTS))
    client, rt, seg = app.test_client(), app.extensions["splitlearn"], segment_of(app)
    per = seg.arch.kv_bytes_per_token(4, seg.start, seg.end)  # float32, by layer type
    window = getattr(seg.config, "sliding_window", None) or 0
    rows, length = 2, 0
    r = client.post(P.SESSIONS, json={"rows": rows}, headers=auth(TOKEN))
    assert r.status_code == 201, r.get_data(as_text=True)
    sid = r.get_json()["session_id"]
    g = torch.Generator().manual_seed(0)
    for T in (7, 1, 1):
        h = torch.randn(rows, T, fam.D, generator=g)
        resp = post_tensors(client, P.SESSION_STEP.format(session_id=sid), {P.HIDDEN: h}, P.SessionStepMeta(length).to_meta())
        assert resp.status_code == 200, resp.get_data(as_text=True)
        length += T
        sliding = per.get(SLIDING, 0) * min(length, window - 1 + T) if window else 0
        kv = rows * (sum(per.values()) * length - per.get(SLIDING, 0) * length + sliding)
        sess = rt.sessions._sessions[sid]
        assert sess.hold.nbytes == int(kv * bm.SESSION_SLACK), (length, kv)
        kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in sess.cache.layers
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)}
        assert sum(kept.values()) <= kv, (length, sum(kept.values()), kv)  # what the cache keeps alive: priced
        if T == 1:
            assert kv == rows * seg.arch.kv_bytes(length, 4, seg.start, seg.end)
    full = rows * length * sum(per.values())
    if name == "gpt2":
        assert kv == full == 2 * 3 * rows * length * fam.D * 4  # 3 layers, K and V of d each
    else:
        assert kv < full  # the window cut it: Gemma 2's one sliding layer of 3, all 3 of Mistral's
