"""Masked offload's arithmetic, pads and checks, in one process (no server):
splitlearn/offload/{field,pads,verify}.py."""
import threading

import pytest
import torch

import splitlearn as sl
from splitlearn.errors import ConfigError, IntegrityError, ServiceUnavailable
from splitlearn.offloadmath import field as F
from splitlearn.offloadmath.layers import QuantisedLayers, linear_weights
from splitlearn.offload.model import linear_modules
from splitlearn.offload.pads import PadPool, Refiller
from splitlearn.offload.verify import Freivalds


@pytest.fixture(scope="module")
def layers():
    return QuantisedLayers(linear_modules(sl.load_model("tiny")))


def test_the_primes_are_prime_and_limits_keep_float64_exact():
    for p in F.PRIMES:
        assert p < 1 << 24 and all(p % d for d in range(2, int(p ** 0.5) + 1))
    for n_in in (32, 768, 3072, 6400):
        lim = F.limits_for(n_in)
        assert n_in * (F.PRIMES[0] - 1) * lim.wmax <= F.EXACT  # every partial sum of X~ Wq < 2^53
        assert n_in * lim.xmax * lim.wmax <= F.HALF  # the product's sign survives the CRT
        assert lim.xmax >= 1 << 17 and lim.wmax >= 1 << 16  # >= 17 bits each for GPT-2 up to XL (4d = 6400)


def test_masked_product_unmasks_to_the_exact_integer_product_with_negative_values():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 768, generator=g) * 3, torch.randn(768, 96, generator=g) * 0.05
    lim = F.limits_for(768)
    wq, sw = F.quantise_weight(w, lim.wmax)
    xq, sx = F.quantise_rows(x, lim.xmax)
    r = torch.stack([F.uniform((7, 768), p) for p in F.PRIMES])
    yq = F.unmask(F.field_matmul(F.mask(xq, r), wq), F.field_matmul(r, wq))
    exact = [[sum(int(a) * int(b) for a, b in zip(xq[i].tolist(), wq[:, j].long().tolist())) for j in range(4)]
             for i in range(2)]  # Python integers: no rounding anywhere
    assert yq[:2, :4].tolist() == exact and bool((yq < 0).any())
    y = F.dequantise(yq, sx, sw).double()
    err = (y - x.double() @ w.double()).abs()
    assert bool((err <= F.error_bound(x, w) + 1e-6).all())  # the stated bound holds (+ float32 rounding)
    assert err.max() < 1e-4


def test_extreme_inputs_stay_in_range():
    lim = F.limits_for(3072)
    w = torch.full((3072, 8), -1.0)
    wq, sw = F.quantise_weight(w, lim.wmax)
    x = torch.full((2, 3072), 1e6)  # every row at its maximum: |yq| = in * xmax * wmax
    xq, sx = F.quantise_rows(x, lim.xmax)
    r = torch.stack([F.uniform((2, 3072), p) for p in F.PRIMES])
    y = F.dequantise(F.unmask(F.field_matmul(F.mask(xq, r), wq), F.field_matmul(r, wq)), sx, sw)
    assert torch.allclose(y.double(), torch.full((2, 8), -3072e6, dtype=torch.float64), rtol=1e-6)


def test_pads_are_uniform_over_the_field():
    p = F.PRIMES[1]
    u = F.uniform((200_000,), p).double() / p
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert bool(((counts - 10_000).abs() < 5 * 10_000 ** 0.5).all())  # each bin within 5 sigma


def test_layer_names_cover_every_linear_and_the_head(layers):
    gpt2 = [f"h.{i}.{n}" for i in range(4) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert list(layers) == gpt2 + ["lm_head"]  # GPT-2's wire names, as before the adapter named them
    assert layers["lm_head"].shape == (32, 257) and layers["h.3.mlp.c_proj"].shape == (128, 32)
    assert QuantisedLayers(linear_modules(sl.load_model("tiny"))).digest() == layers.digest()
    assert QuantisedLayers(linear_modules(sl.load_model("tiny", seed=1))).digest() != layers.digest()


@pytest.mark.parametrize("name", ["llama-mha", "llama-gqa", "gemma2"])
def test_a_llamas_linear_layers_are_its_tp_plans_in_in_out_layout(name):
    import families as fam
    model = fam.model(name)
    c = model.config
    modules = linear_modules(model)
    plan = [k.replace("*", str(i)) for i in range(c.num_hidden_layers) for k in c.base_model_tp_plan]
    assert list(modules) == plan + ["lm_head"]  # q, k, v, o, gate, up, down per layer, then the head
    hd = c.head_dim or c.hidden_size // c.num_attention_heads
    w = linear_weights(modules)
    assert w["layers.0.self_attn.q_proj"][0].shape == (c.hidden_size, c.num_attention_heads * hd)
    assert w["layers.2.self_attn.k_proj"][0].shape == (c.hidden_size, c.num_key_value_heads * hd)  # GQA: fewer
    assert w["layers.3.mlp.down_proj"][0].shape == (c.intermediate_size, c.hidden_size)
    assert w["lm_head"][0].shape == (c.hidden_size, c.vocab_size)
    x = torch.randn(3, c.hidden_size)
    lin = model.model.layers[1].mlp.up_proj  # nn.Linear: weight (out, in); x W must be its forward
    assert torch.allclose(x @ w["layers.1.mlp.up_proj"][0], lin(x), atol=1e-6)


def test_freivalds_catches_any_altered_element_in_either_prime(layers):
    q = layers["h.1.mlp.c_fc"]
    check = Freivalds(q)
    xt = torch.stack([F.uniform((5, 32), p) for p in F.PRIMES])
    z = F.field_matmul(xt, q.wq)
    check.check(xt, z)  # the honest answer passes
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        bad = z.clone()
        i, row, col = trial % 2, int(torch.randint(5, (1,), generator=g)), int(torch.randint(128, (1,), generator=g))
        delta = int(torch.randint(1, F.PRIMES[i], (1,), generator=g))
        bad[i, row, col] = (int(bad[i, row, col]) + delta) % F.PRIMES[i]
        with pytest.raises(IntegrityError, match="Freivalds"):
            check.check(xt, bad)
    with pytest.raises(IntegrityError, match="outside"):
        check.check(xt, z + F.PRIMES[0])
    with pytest.raises(IntegrityError, match="int32"):
        check.check(xt, z[:, :4])
    assert check.checks == 1


def test_a_pool_hands_out_every_row_once_and_computes_more_when_empty(layers):
    q = layers["h.0.attn.c_attn"]
    pool = PadPool(q, capacity=40)
    assert pool.refill() == 40 and pool.level == 40
    taken = [pool.take(n) for n in (3, 17, 1, 19, 12, 5)]  # 57 rows: 40 precomputed + 17 made on the spot
    serials = [s for t in taken for s in range(t.first, t.first + t.r.shape[1])]
    assert serials == list(range(57)) and pool.issued == 57 and pool.late == 17 and pool.level == 0
    rows = torch.cat([t.r for t in taken], dim=1)  # (2, 57, in)
    assert len({tuple(r) for r in rows[0].tolist()}) == 57  # no row handed out twice
    for t in taken:  # each pad's unmasking factor is R Wq mod p
        assert torch.equal(t.u, F.field_matmul(t.r, q.wq))


def test_an_exhausted_pool_raises_or_waits_never_reuses(layers):
    q = layers["h.0.mlp.c_proj"]
    strict = PadPool(q, capacity=4, on_empty="raise")
    strict.refill()
    strict.take(4)
    with pytest.raises(ServiceUnavailable, match="exhausted"):
        strict.take(1)
    waiting = PadPool(q, capacity=8, on_empty="wait")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("pads", waiting.take(6)))
    t.start()
    refiller = Refiller([waiting], poll_s=0.01)  # the background thread makes the rows
    t.join(30)
    refiller.close()
    assert got["pads"].r.shape == (2, 6, 128) and got["pads"].first == 0 and waiting.late == 0
    with pytest.raises(ConfigError):
        PadPool(q, capacity=4, on_empty="reuse")
