"""Masked offload against a real ``python -m splitlearn.server --model tiny --offload`` server
(its app behind its front door on a loopback port, in this process, with two test hooks in a
runtime subclass): tokens equal the unsplit model's, what the server receives is uncorrelated
with the true activations, a tampering server is caught, pads are never reused, bad requests
get 4xx."""
import pytest
import requests
import torch

import splitlearn as sl
from splitlearn import OffloadGPT2LMHeadModel
from splitlearn.api import protocol as P
from splitlearn.errors import ConfigError, IntegrityError
from splitlearn.offload.model import linear_modules
from splitlearn.offloadmath import field as F
from splitlearn.offloadmath.layers import QuantisedLayers
from splitlearn.server.config import ServerConfig
from splitlearn.api.wire import decode, encode

from serverproc import TOKEN, auth

from offloadserver import LOGIT_TOL, offload_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with offload_server("--offload-plain", record=tmp_path_factory.mktemp("record")) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference():
    return sl.load_model("tiny")


def client(srv, **kw) -> OffloadGPT2LMHeadModel:
    return OffloadGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=TOKEN, refill="none", **kw)


def prompt(rows=2, length=12, seed=0):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def recorded(srv) -> list[tuple[dict, dict]]:
    return [decode(p.read_bytes()) for p in sorted(srv.record.glob("*.safetensors"))]


def test_greedy_tokens_and_logits_equal_the_unsplit_model(server, reference):
    model = client(server)
    ids = prompt()
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert (want - got).abs().max() < LOGIT_TOL
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=256, attention_mask=torch.ones_like(ids))
    assert torch.equal(model.generate(ids, **kw), reference.generate(ids, **kw))
    s = model.offload_stats
    # 4 products per block + the head, per forward (1 + 10); products of >= 16 rows go as 2 row
    # groups: all 17 of the first forward (24 rows), the prefill's 16 block products (the head: 2 rows)
    assert s["products"] == 11 * 17 and s["requests"] == s["products"] + 17 + 16
    # every row took its own pad; the head's pool (32 rows, no refill thread) ran out after
    # 24 + 4 x 2 rows: the other 12 were made on the spot, never reused
    assert s["pads_issued"] == s["rows"] and s["pads_late"] == 12
    model.close()


def test_what_the_server_receives_is_uncorrelated_with_the_activations(server, reference):
    before = len(recorded(server))
    ids = prompt(rows=4, length=16, seed=3)
    truth = {}  # layer -> the true input rows, as the reference model computes them

    def keep(name):
        def hook(_module, args):
            truth[name.removeprefix("transformer.")] = args[0].reshape(-1, args[0].shape[-1])
        return hook

    hooks = [mod.register_forward_pre_hook(keep(name))
             for name, mod in reference.named_modules() if name.endswith(("c_attn", "c_proj", "c_fc"))]
    with torch.no_grad():
        reference(ids)
    for h in hooks:
        h.remove()
    for scheme in ("masked", "plain"):
        model = client(server, scheme=scheme, lanes=1)
        with torch.no_grad():
            model(ids)
        model.close()
    got = recorded(server)[before:]
    assert len(got) == 2 * 17
    masked, plain = got[:17], got[17:]
    xs, ts = [], []
    for (t, meta), (tp, _) in zip(masked, plain):
        if meta["layers"] == "lm_head":
            continue
        true = truth[meta["layers"]]  # (64, in) float32
        xq, _ = F.quantise_rows(true, F.limits_for(true.shape[1]).xmax)
        assert t["x.0"].shape == (2, 64, true.shape[1]) and t["x.0"].dtype == torch.int32
        for i, p in enumerate(F.PRIMES):
            xs.append(t["x.0"][i].double().flatten() / p)
            ts.append(xq.double().flatten())
        assert torch.equal(tp["x.0"], true)  # the plain baseline does hand over the activations
    x, truth_all = torch.cat(xs), torch.cat(ts)
    corr = torch.corrcoef(torch.stack([x, truth_all]))[0, 1].item()
    assert abs(corr) < 4 / x.numel() ** 0.5, corr  # ~N(0, 1/N) under independence; N ~ 60k
    ks = (torch.sort(x).values - torch.arange(x.numel()) / x.numel()).abs().max().item()
    assert ks < 1.63 / x.numel() ** 0.5 * 1.5, ks  # Kolmogorov-Smirnov against uniform over Z_p
    # the same activations, sent twice, arrive as different (fresh) pads
    t0 = masked[0][0]["x.0"]
    model = client(server, lanes=1)
    with torch.no_grad():
        model(ids)
    model.close()
    again = recorded(server)[before + 34][0]["x.0"]
    assert not bool((again == t0).any(dim=-1).all()) and (again == t0).double().mean() < 1e-3


@pytest.fixture(scope="module")
def hostile():
    """A server of other weights (seed 1) that alters every answer from its 30th product on,
    with 1 MiB per request and no plain products."""
    with offload_server("--seed", "1", "--max-request-memory-gb", "0.001", tamper=30) as srv:
        yield srv


def test_a_client_refuses_a_server_with_other_weights(hostile):
    with pytest.raises(ConfigError, match="digest"):
        client(hostile)  # seed 0 here, seed 1 there


def test_a_tampering_server_is_caught_and_no_tokens_come_back(hostile):
    model = client(hostile, seed=1)
    out = None
    with pytest.raises(IntegrityError, match="Freivalds"):
        out = model.generate(prompt(), max_new_tokens=4, do_sample=False, pad_token_id=256,
                             attention_mask=torch.ones(2, 12, dtype=torch.long))
    assert out is None and model.offload_stats["requests"] == 30  # caught at the first altered answer
    model.close()
    unchecked = client(hostile, seed=1, verify=False)  # what the check prevents: silently wrong logits
    with torch.no_grad():
        bad = unchecked(prompt()).logits
    assert not torch.allclose(bad, sl.load_model("tiny", seed=1)(prompt()).logits, atol=1.0)
    unchecked.close()


def body(tensors, layers="h.0.attn.c_attn", scheme="masked"):
    return encode(tensors, {"layers": layers, "scheme": scheme})


def post(srv, data, token=TOKEN):
    return requests.post(srv.url + P.OFFLOAD_LINEAR, data=data, timeout=30,
                         headers={**auth(token), "Content-Type": P.CONTENT_TYPE})


def test_two_products_in_one_request_are_exact(server):
    q = QuantisedLayers(linear_modules(sl.load_model("tiny")))
    a = torch.stack([F.uniform((3, 32), p) for p in F.PRIMES])
    b = torch.stack([F.uniform((5, 128), p) for p in F.PRIMES])
    r = post(server, body({"x.0": a, "x.1": b}, "h.2.mlp.c_fc,h.2.mlp.c_proj"))
    assert r.status_code == 200 and float(r.headers[P.SERVER_TIME_HEADER]) > 0
    t, _ = decode(r.content)
    assert torch.equal(t["y.0"], F.field_matmul(a, q["h.2.mlp.c_fc"].wq))
    assert torch.equal(t["y.1"], F.field_matmul(b, q["h.2.mlp.c_proj"].wq))


def test_bad_requests_get_4xx_before_any_compute(server):
    ok = torch.stack([F.uniform((2, 32), p) for p in F.PRIMES])
    cases = [
        (body({"x.0": ok}, "h.9.attn.c_attn"), 400, "unknown layer"),
        (body({"x.0": ok}, "h.0.attn.c_attn,h.0.mlp.c_fc"), 400, "exactly the tensors"),
        (body({"x.0": ok.long()}), 400, "int32"),
        (body({"x.0": ok[:, :, :16]}), 400, "int32 [2, rows, 32]"),
        (body({"x.0": ok + F.PRIMES[0]}), 400, "outside"),
        (body({"x.0": ok}, scheme="cleartext"), 400, "scheme"),
        (body({"x.0": ok}, ",".join(["lm_head"] * 9)), 400, "1..8"),
        (b"\x00" * 16, 400, "safetensors"),
    ]
    for data, status, words in cases:
        r = post(server, data)
        assert r.status_code == status and words in r.json()["message"], (words, r.status_code, r.text)
    assert post(server, body({"x.0": ok}), token="wrong-token-123456789").status_code == 401
    assert requests.post(server.url + P.SESSIONS, headers=auth(), timeout=30).status_code == 404  # no segment routes
    info = requests.get(server.url + P.INFO, headers=auth(), timeout=30).json()
    assert info["mode"] == "offload" and info["offload"]["primes"] == list(F.PRIMES)


def test_plain_products_need_the_servers_consent_and_memory_is_capped(hostile):
    r = post(hostile, body({"x.0": torch.randn(2, 32)}, scheme="plain"))
    assert r.status_code == 400 and "--offload-plain" in r.json()["message"]
    big = torch.zeros(2, 1000, 32, dtype=torch.int32)  # 1000 rows x (32 + 96) x 16 B > 1 MiB
    assert post(hostile, body({"x.0": big})).status_code == 413


def test_offload_configuration_is_checked():
    base = dict(model="tiny", tokens=(TOKEN,))
    with pytest.raises(ConfigError, match="no --cut"):
        ServerConfig(**base, offload=True, cuts=(2,))
    with pytest.raises(ConfigError, match="need --offload"):
        ServerConfig(**base, cuts=(2,), offload_plain=True)
    with pytest.raises(TypeError):  # the tests' hooks are no configuration (HookedOffload)
        ServerConfig(**base, offload=True, offload_tamper=3)
    assert ServerConfig(**base, offload=True).cuts == ()
