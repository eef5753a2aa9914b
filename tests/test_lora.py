"""splitlearn.model.lora: the spec, the init, the router's deltas against peft, mixed-adapter batched decode."""
import copy

import pytest
import torch
from peft import get_peft_model

import splitlearn as sl
from splitlearn.errors import ConfigError
from splitlearn.model.lora import AdaptedSegment, LoraRouter, LoraSpec, init_adapter_pair, lora_scope
from splitlearn.server.engine.batching import DecodeItem, batched_decode
from splitlearn.server.http.cli import main as server_main

SPEC = LoraSpec(r=4, alpha=8.0, targets=("c_attn", "c_proj", "c_fc"))


@pytest.mark.parametrize("kwargs, words", [
    (dict(r=0), "r must be"), (dict(r=-2), "r must be"), (dict(r=2.5), "r must be"),
    (dict(alpha=0), "alpha"), (dict(alpha=-1.0), "alpha"), (dict(dropout=1.0), "dropout"),
    (dict(targets=("attn.c_attn",)), "not module names"), (dict(targets=()), "at least one"),
    (dict(targets=("c_attn", "c_attn")), "duplicated"),
])
def test_bad_specs_are_config_errors(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        LoraSpec(**kwargs)


@pytest.mark.parametrize("targets, missing", [(("wqkv",), "'wqkv'"), (("c_attn", "q_proj"), "'q_proj'"),
                                              (("wte",), "'wte'")])  # an embedding is no target
def test_a_target_the_segment_lacks_is_refused_naming_what_it_has(targets, missing):
    seg = sl.partition(sl.load_model("tiny"), (1, 3)).trunk
    with pytest.raises(ConfigError, match=f"no LoRA target module {missing}: its layers' linear modules are "
                                          f"c_attn, c_fc, c_proj \\("):
        LoraRouter(seg, LoraSpec(r=4, targets=targets))
    assert not any(m._forward_hooks for m in seg.modules()) and not hasattr(seg, "lora_router")  # nothing hooked


def test_no_targets_is_the_familys_default_from_peft():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table
    seg = sl.partition(sl.load_model("tiny"), (1, 3)).trunk
    router = LoraRouter(seg, LoraSpec(r=4))
    assert router.spec.targets == tuple(table["gpt2"]) == ("c_attn",)  # GPT-2's default, as before
    assert LoraSpec(r=4) == LoraSpec.from_dict(LoraSpec(r=4).to_dict())  # unresolved round-trips


@pytest.mark.parametrize("argv", [["--lora-r", "0"], ["--lora-r", "4", "--lora-targets", "c_attn,wte"],
                                  ["--lora-r", "4", "--lora-alpha", "0"], ["--lora-alpha", "8"]])
def test_the_server_refuses_bad_lora_options_at_start(argv, capsys):
    assert server_main(["--model", "tiny", "--cut", "2", *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_init_is_deterministic_peft_like_and_distinct_per_client():
    a1, b1 = init_adapter_pair(0, "x", "transformer.h.0.attn.c_attn", 32, 96, 4)
    a2, _ = init_adapter_pair(0, "x", "transformer.h.0.attn.c_attn", 32, 96, 4)
    a3, _ = init_adapter_pair(0, "y", "transformer.h.0.attn.c_attn", 32, 96, 4)
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    assert a1.shape == (4, 32) and b1.shape == (96, 4) and not b1.any()
    assert a1.abs().max() <= 32 ** -0.5  # kaiming_uniform(a=sqrt(5)) bound 1/sqrt(fan_in)


def _trunk():
    model = sl.load_model("tiny")
    return model, sl.partition(model, (1, 3)).trunk


def _random_adapter(router, seed):
    ad = router.new_adapter(0, f"c{seed}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in ad.lora_B:
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return ad


def test_router_adds_the_same_delta_as_peft_and_leaves_the_base_alone():
    model, trunk = _trunk()
    router = LoraRouter(trunk, SPEC)
    assert not any(p.requires_grad for p in trunk.parameters())
    ad = _random_adapter(router, 1)
    ref = get_peft_model(sl.load_model("tiny"), SPEC.to_peft()).base_model.model
    sd = ad.tensors(prefix="")
    for name, m in ref.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A and f"{name}.lora_A.weight" in sd:
            with torch.no_grad():
                m.lora_A["default"].weight.copy_(sd[f"{name}.lora_A.weight"])
                m.lora_B["default"].weight.copy_(sd[f"{name}.lora_B.weight"])
    ref_trunk = sl.partition(ref, (1, 3)).trunk.eval()
    h = torch.randn(2, 5, 32)
    with torch.no_grad():
        base = trunk.eval()(h)
        with lora_scope(trunk, ad):
            got = trunk(h)
        want = ref_trunk(h)
        assert torch.equal(trunk(h), base)  # outside the scope: the base again
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, base)


def test_adapted_segment_trains_its_adapter_only_and_copies_share_the_base():
    _, trunk = _trunk()
    router = LoraRouter(trunk, SPEC)
    seg = AdaptedSegment(router, router.new_adapter(0, "a"))
    base = {k: v.clone() for k, v in trunk.state_dict().items()}
    opt = torch.optim.SGD(seg.parameters(), lr=0.5)
    seg.train()
    seg(torch.randn(2, 5, 32)).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(base[k], v) for k, v in trunk.state_dict().items())
    assert any(b.abs().sum() > 0 for b in seg.adapter.lora_B)
    twin = copy.deepcopy(seg)
    assert twin.base is trunk and twin.adapter is not seg.adapter
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), seg.parameters()))
    assert set(seg.state_dict()) == {k for k in seg.state_dict() if k.startswith("adapter.")}


@pytest.mark.parametrize("cuts", [(1, 3), (2,)])
def test_batched_decode_with_mixed_adapters_equals_each_session_alone(cuts):
    model = sl.load_model("tiny")
    parts = sl.partition(model, cuts)
    seg = (parts.trunk if parts.u_shape else parts.top).eval()
    router = LoraRouter(seg, SPEC)
    adapters = [_random_adapter(router, 1), None, _random_adapter(router, 2), _random_adapter(router, 1)]
    adapters[3] = adapters[0]  # two sessions of one client, split by another's rows
    g = torch.Generator().manual_seed(0)
    rows = [1, 2, 3, 2]
    prompts = [torch.randn(n, 4, 32, generator=g) for n in rows]
    caches = [[seg.new_cache() for _ in rows] for _ in range(2)]
    with torch.no_grad():
        for copy_ in caches:
            for c, p, ad in zip(copy_, prompts, adapters):
                with lora_scope(seg, ad):
                    seg(p, None, c)
    for _ in range(3):
        new = [torch.randn(n, 1, 32, generator=g) for n in rows]
        with torch.no_grad():
            want = []
            for x, c, ad in zip(new, caches[0], adapters):
                with lora_scope(seg, ad):
                    want.append(seg(x, None, c))
        got = batched_decode(seg, [DecodeItem(c, x, adapter=ad) for c, x, ad in zip(caches[1], new, adapters)])
        for w, o in zip(want, got):
            torch.testing.assert_close(o, w, atol=1e-6, rtol=1e-5)
    # and the adapters did matter: the base-only row differs from an adapted one on the same input
    x = torch.randn(1, 1, 32, generator=g)
    a = [seg.new_cache() for _ in range(2)]
    with torch.no_grad():
        outs = batched_decode(seg, [DecodeItem(a[0], x, adapter=None), DecodeItem(a[1], x, adapter=adapters[0])])
    assert not torch.allclose(outs[0], outs[1])
