"""Seed 000 on its own model: masked offload of a Llama's linear layers (q, k, v, o, gate, up, down
and the LM head), MHA and GQA, and of a Gemma 2 (alternating sliding layers, softcaps), against a
real ``--offload`` server of a saved tiny model (tests/offloadserver.py), on a left-padded batch:
logits bit for bit those of the client-only model with its linear layers in the scheme's fixed
point (also once q, k, v and gate, up go in one request each), within REL_TOL of the float model's,
greedy tokens equal to the client-only model's; what
the server receives is uniform and uncorrelated with the activations; a server that returns a
wrong product is caught by Freivalds' check; another model is refused at connect."""
import pytest
import requests
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import families as fam
from splitlearn import AutoOffloadModelForCausalLM, OffloadGPT2LMHeadModel
from splitlearn.api import protocol as P
from splitlearn.api.wire import decode, encode
from splitlearn.errors import ConfigError, IntegrityError
from splitlearn.model.arch import arch_of
from splitlearn.offload.model import linear_modules
from splitlearn.offload.remote import RemoteLinear
from splitlearn.offloadmath import field as F
from splitlearn.offloadmath.layers import in_out

from offloadserver import offload_server
from serverproc import TOKEN, auth

NEW = 5  # greedy tokens generated
#: max |logit - the float model's| relative to max |logit|: the fixed point's error (docs/OFFLOAD.md,
#: "Other families"); measured 1.7e-5 (Llama MHA), 3.4e-5 (GQA), 4e-6 (Gemma 2) with these configs'
#: initializer_range 0.3 (GPT-2 tiny's 0.02 gives 1e-6 absolute, LOGIT_TOL)
REL_TOL = 1e-4


class FixedPoint(nn.Module):
    """A linear layer computed locally as the scheme computes it: ``sx sw (xq Wq) + b``, the
    integer product exact in float64 (what unmasking returns: tests/test_offload_field.py)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        w, self.b = in_out(linear)
        self.lim = F.limits_for(w.shape[0])
        self.wq, self.sw = F.quantise_weight(w, self.lim.wmax)

    def forward(self, x):
        xq, sx = F.quantise_rows(x.reshape(-1, x.shape[-1]), self.lim.xmax)
        y = F.dequantise(xq.double() @ self.wq, sx, self.sw)
        y = y if self.b is None else y + self.b.detach()
        return y.reshape(*x.shape[:-1], -1)


def fixed_point(d):
    """The client-only model with every offloaded linear layer in the scheme's fixed point."""
    model = reference(d)
    paths = arch_of(model.config).linear_paths(model)
    for name, m in linear_modules(model).items():
        model.set_submodule(paths[name], FixedPoint(m))
    return model


@pytest.fixture(scope="module", params=["llama-mha", "llama-gqa", "gemma2"])
def served(request, tmp_path_factory):
    """(family, saved dir, its offload server recording every input)."""
    name = request.param
    d = tmp_path_factory.mktemp(name)
    fam.model(name).save_pretrained(d)
    with offload_server(model=str(d), record=tmp_path_factory.mktemp(f"{name}-record")) as srv:
        yield name, d, srv


def reference(d):
    return AutoModelForCausalLM.from_pretrained(d).eval()


def client(srv, d, **kw):
    return AutoOffloadModelForCausalLM.from_pretrained(str(d), server=srv.url, token=TOKEN, refill="none", **kw)


def test_logits_and_greedy_tokens_equal_the_client_only_model(served):
    name, d, srv = served
    ref = reference(d)
    model = client(srv, d)
    c = model.config
    assert isinstance(model, type(ref)) and type(model).__name__ == f"Offload{type(ref).__name__}"
    assert list(model.state_dict()) == list(ref.state_dict())  # the family's names, unchanged
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]  # every linear is remote
    remote = [m.name for m in model.modules() if isinstance(m, RemoteLinear)]
    per_layer = [k.split("*.", 1)[1] for k in c.base_model_tp_plan]  # q, k, v, o, gate, up, down
    assert sorted(remote) == sorted([f"layers.{i}.{s}" for i in range(c.num_hidden_layers) for s in per_layer]
                                    + ["lm_head"])
    ids, mask = fam.padded()  # row 0 left-padded by 3
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits  # learns the siblings: 7 requests a layer
        again = model(ids, attention_mask=mask).logits  # q, k, v in one request, gate and up in one: 4
        exact = fixed_point(d)(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert torch.equal(got, exact)  # masking, pads, CRT and the checks change no bit of the products
    assert torch.equal(again, exact)
    assert (want[keep] - got[keep]).abs().max() < REL_TOL * want[keep].abs().max()
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=fam.PAD, attention_mask=mask)
    out = model.generate(ids, **kw)
    assert torch.equal(out, ref.generate(ids, **kw)) and out.shape[1] == ids.shape[1] + NEW
    s = model.offload_stats
    forwards = 2 + NEW  # the logits twice, then generate's
    assert s["products"] == len(remote) * forwards  # every linear layer once per forward
    # 14 rows: below the row-group size; the first forward one request a product, then one per
    # group of siblings: {q, k, v}, o, {gate, up}, down a layer, and the head
    assert s["requests"] == len(remote) + (forwards - 1) * (4 * c.num_hidden_layers + 1)
    assert s["ahead"] == (forwards - 1) * 3 * c.num_hidden_layers
    assert model.offload_channel.groups["layers.2.self_attn.k_proj"] == tuple(
        f"layers.2.self_attn.{p}_proj" for p in "qkv")
    assert s["pads_issued"] == s["rows"]  # a fresh pad for every row of every product
    model.close()


def test_what_the_server_receives_is_uniform_and_uncorrelated_with_the_activations(served):
    name, d, srv = served
    if name != "llama-gqa":
        pytest.skip("once: the recording of the GQA Llama (the maths is the family's linear layers')")
    ref = reference(d)
    ids, mask = fam.padded(batch=4, length=8, seed=2)
    truth = {}  # wire name -> the true input rows, as the client-only model computes them

    def keep(name):
        def hook(_module, args):
            truth[name.removeprefix("model.")] = args[0].reshape(-1, args[0].shape[-1])
        return hook

    hooks = [m.register_forward_pre_hook(keep(n)) for n, m in ref.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        ref(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    before = len(list(srv.record.glob("*.safetensors")))
    model = client(srv, d, lanes=1)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    model.close()
    got = [decode(p.read_bytes()) for p in sorted(srv.record.glob("*.safetensors"))[before:]]
    assert len(got) == 7 * 4 + 1
    xs, ts = [], []
    for t, meta in got:
        if meta["layers"] == "lm_head":
            continue
        true = truth[meta["layers"]]  # (32, in) float32
        xq, _ = F.quantise_rows(true, F.limits_for(true.shape[1]).xmax)
        assert t["x.0"].shape == (2, 32, true.shape[1]) and t["x.0"].dtype == torch.int32
        for i, p in enumerate(F.PRIMES):
            xs.append(t["x.0"][i].double().flatten() / p)
            ts.append(xq.double().flatten())
    x, truth_all = torch.cat(xs), torch.cat(ts)
    corr = torch.corrcoef(torch.stack([x, truth_all]))[0, 1].item()
    assert abs(corr) < 4 / x.numel() ** 0.5, corr  # ~N(0, 1/N) under independence; N ~ 70k
    ks = (torch.sort(x).values - torch.arange(x.numel()) / x.numel()).abs().max().item()
    assert ks < 1.63 / x.numel() ** 0.5 * 1.5, ks  # Kolmogorov-Smirnov against uniform over Z_p


def test_another_model_is_refused_at_connect_and_wrong_layer_names_get_400(served, tmp_path):
    name, d, srv = served
    if name != "llama-gqa":
        pytest.skip("once")
    other = tmp_path / "other"
    fam.model(name, seed=1).save_pretrained(other)  # the same config, other weights
    with pytest.raises(ConfigError, match="digest"):
        client(srv, other)
    mha = tmp_path / "mha"
    fam.model("llama-mha").save_pretrained(mha)  # other heads: refused naming the fields
    with pytest.raises(ConfigError, match="num_attention_heads: this side 2, the server 4"):
        client(srv, mha)
    with pytest.raises(ConfigError, match="AutoOffloadModelForCausalLM"):
        OffloadGPT2LMHeadModel.from_pretrained(str(d), server=srv.url, token=TOKEN)
    ok = torch.stack([F.uniform((2, 32), p) for p in F.PRIMES])
    r = requests.post(srv.url + P.OFFLOAD_LINEAR, data=encode({"x.0": ok}, {"layers": "h.0.attn.c_attn"}),
                      headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE}, timeout=30)
    assert r.status_code == 400 and "layers.<i>.self_attn.q_proj" in r.json()["message"]
    r = requests.post(srv.url + P.OFFLOAD_LINEAR, data=encode({"x.0": ok},
                                                               {"layers": "layers.1.self_attn.k_proj"}),
                      headers={**auth(TOKEN), "Content-Type": P.CONTENT_TYPE}, timeout=30)
    assert r.status_code == 200 and decode(r.content)[0]["y.0"].shape == (2, 2, 16)  # GQA's k_proj: d -> 16


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A GQA Llama's offload server that alters one element of every answer from its 40th product on
    (the prefill is 29 products: the 11th of the first decode step)."""
    d = tmp_path_factory.mktemp("hostile")
    fam.model("llama-gqa").save_pretrained(d)
    with offload_server(model=str(d), tamper=40) as srv:
        yield d, srv


def test_a_server_returning_a_wrong_product_is_caught_by_freivalds(hostile):
    d, srv = hostile
    model = client(srv, d)
    ids, mask = fam.padded()
    out = None
    with pytest.raises(IntegrityError, match="Freivalds"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=fam.PAD)
    # caught at the first altered answer: the 40th product, layer 1's o_proj in the 35th request (the
    # prefill's 29, then {q, k, v}, o, {gate, up}, down, {q, k, v}, o); the 39 before it passed
    assert out is None and model.offload_stats["requests"] == 35
    assert sum(layer.check.checks for layer in model.offload_channel.layers.values()) == 39
    model.close()
    unchecked = client(srv, d, verify=False)  # what the check prevents: silently wrong logits
    ids, mask = fam.padded(pad=0)  # the server alters row 0's first element: a real token here
    with torch.no_grad():
        bad = unchecked(ids, attention_mask=mask).logits
        want = reference(d)(ids, attention_mask=mask).logits
    assert not torch.allclose(bad, want, atol=1.0)
    unchecked.close()


def test_a_product_sent_ahead_is_used_only_for_the_same_unchanged_input(served):
    name, d, srv = served
    if name != "llama-gqa":
        pytest.skip("once")
    model = client(srv, d)
    ids, mask = fam.padded()
    local = fixed_point(d).model.layers[0].self_attn  # the products, computed here
    attn = model.model.layers[0].self_attn
    stats = model.offload_channel.stats
    with torch.no_grad():
        model(ids, attention_mask=mask)  # learns {q, k, v}
        x = torch.randn(2, 3, model.config.hidden_size)
        attn.q_proj(x)  # sends q, k and v of x in one request
        r0 = stats.requests
        assert torch.equal(attn.k_proj(x), local.k_proj(x)) and stats.requests == r0  # the one sent ahead
        attn.q_proj(x)
        x.mul_(2)  # changed in place after q, k, v were sent: v's product is stale
        assert torch.equal(attn.v_proj(x), local.v_proj(x)) and stats.requests == r0 + 2  # computed afresh
        attn.q_proj(x)
        y = x.clone()  # the same values in another tensor: not the input they were sent for
        assert torch.equal(attn.k_proj(y), local.k_proj(y)) and stats.requests == r0 + 4
    model.close()


@pytest.mark.parametrize("name", [n for n in fam.NAMES if n not in ("llama-mha", "llama-gqa", "gemma2")])
def test_every_other_family_offloads_exactly(name, tmp_path):
    """Qwen2/3, Mistral, Gemma, Gemma 3, Phi-3 (fused qkv_proj, gate_up_proj), GPT-NeoX, OPT, Falcon
    (alibi and rotary), GPT-2 through AutoOffloadModelForCausalLM: the logits bit for bit the
    fixed-point model's (before and after siblings are learned), within REL_TOL of the float
    model's, 3 greedy tokens equal."""
    fam.model(name).save_pretrained(tmp_path)
    with offload_server(model=str(tmp_path)) as srv:
        model = client(srv, tmp_path)
        ref = reference(tmp_path)
        ids, mask = fam.padded()
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
            again = model(ids, attention_mask=mask).logits
            exact = fixed_point(tmp_path)(ids, attention_mask=mask).logits
            want = ref(ids, attention_mask=mask).logits
        keep = mask.bool()
        assert torch.equal(got, exact) and torch.equal(again, exact)
        assert (want[keep] - got[keep]).abs().max() < REL_TOL * want[keep].abs().max()
        kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=fam.PAD, attention_mask=mask)
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
        model.close()
