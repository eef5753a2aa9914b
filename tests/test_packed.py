"""``PackedLinears``: the same outputs as the layers' own products, fresh after training."""
import pytest
import torch

import splitlearn as sl
from splitlearn.model.packed import PackedLinears, usable


@pytest.fixture()
def parts():
    return sl.partition(sl.load_model("tiny"), (1, 3))


pytestmark = pytest.mark.skipif(not usable(torch.nn.Linear(2, 2)), reason="no oneDNN in this torch build")


def _decode(seg, x, steps=3):
    """Prefill + decode steps with a cache; the outputs, concatenated."""
    cache, outs = seg.new_cache(), []
    with torch.no_grad():
        outs.append(seg(x[:, :-steps], None, cache))
        for i in range(steps, 0, -1):
            outs.append(seg(x[:, -i:][:, :1], None, cache))
    return torch.cat(outs, dim=1)


class _AlwaysPacked(dict):
    def get(self, key, default=None):
        return True


def test_packed_outputs_equal_the_layers_own_within_float32_rounding(parts, monkeypatch):
    import splitlearn.model.packed as packed_mod

    monkeypatch.setattr(packed_mod, "CHOICE", _AlwaysPacked())  # this host's choice aside
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, parts.config.vocab_size, (3, 9), generator=g)
    h = torch.randn(3, 9, parts.config.n_embd, generator=g)
    for seg, x in ((parts.bottom, ids), (parts.trunk, h), (parts.top, h)):
        seg.eval()
        plain = _decode(seg, x)
        packed = PackedLinears(seg)
        assert len(packed) > 0
        with packed.active():
            fast = _decode(seg, x)
        assert all(p.packed is not None for p in packed._weights)  # every product ran on a packed weight
        torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)


def test_a_shared_weight_is_packed_once_and_layers_are_restored(parts):
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.weight = a.weight  # tied, as GPT-2's LM head and embedding are
    assert (len(PackedLinears(torch.nn.Sequential(a, b))), len(PackedLinears(torch.nn.Sequential(a, b))._weights)) == (2, 1)
    top = parts.top.eval()
    packed = PackedLinears(top)
    assert len(packed) == 4 * len(top.h) + 1  # c_attn, attn.c_proj, c_fc, mlp.c_proj; the LM head
    with packed.active():
        with packed.active():  # nested: the inner exit must not undo the outer
            pass
        assert "forward" in vars(top.lm_head)
    assert all("forward" not in vars(m) for m in top.modules())


def test_a_weight_trained_inside_or_between_blocks_is_repacked(parts):
    trunk = parts.trunk.eval()
    h = torch.randn(2, 4, parts.config.n_embd, generator=torch.Generator().manual_seed(1))
    packed = PackedLinears(trunk)
    with packed.active():
        before = trunk(h).detach()  # grad on: the layers' own products
        with torch.no_grad():
            first = trunk(h)
            for p in trunk.parameters():
                p.mul_(1.5)  # as an optimizer step would, in place
            second = trunk(h)
    torch.testing.assert_close(first, before, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(second, trunk(h), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first, second)


def test_gradients_flow_through_the_layers_own_products(parts):
    bottom = parts.bottom.train()
    packed = PackedLinears(bottom)
    ids = torch.randint(0, parts.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    with packed.active():
        bottom(ids).sum().backward()
    assert all(p.grad is not None for p in bottom.parameters() if p.requires_grad)


def test_two_packers_of_one_model_share_the_copy_and_the_layers(parts):
    """Clients built from one model object pack its weights once; one client's generation
    ending does not unpack the layers under another's."""
    trunk = parts.trunk.eval()
    first, second = PackedLinears(trunk), PackedLinears(trunk)
    assert all(a is b for a, b in zip(first._weights, second._weights))
    layer = first._layers[0][0]
    with first.active():
        with second.active():
            pass
        assert "forward" in vars(layer)  # still packed for `first`
    assert "forward" not in vars(layer)


def test_a_weight_collected_while_the_lock_is_held_does_not_deadlock():
    # The garbage collector runs a dead weight's finalizer (packed._forget) wherever it runs,
    # e.g. inside active(), which holds the lock while it sets each layer's forward: seen as a
    # hung server (a decode step that never answered). The lock must be re-entrant.
    import threading

    from splitlearn.model import packed as pk

    layer = torch.nn.Linear(4, 4)
    PackedLinears(layer)
    key = id(layer.weight)
    assert key in pk._STORE

    def collect_inside_the_lock():
        with pk._LOCK:
            layer.weight = torch.nn.Parameter(torch.zeros(4, 4))  # the old weight dies: _forget runs

    t = threading.Thread(target=collect_inside_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the finalizer waited for a lock its own thread holds"
    assert key not in pk._STORE or pk._STORE[key].weight is not None


def test_each_shape_and_size_runs_where_it_measured_faster(monkeypatch):
    import splitlearn.model.packed as packed_mod

    monkeypatch.setattr(packed_mod, "CHOICE", {(16, 8, 1): False, (16, 8, 4): True})
    layer = torch.nn.Linear(16, 8).eval()
    packed = PackedLinears(torch.nn.Sequential(layer))
    weight = packed._weights[0]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad(), packed.active():
        x1 = torch.randn(1, 1, 16, generator=g)
        assert torch.equal(layer(x1), torch.nn.functional.linear(x1, layer.weight, layer.bias))  # its own product
        assert weight.packed is None
        x4 = torch.randn(2, 2, 16, generator=g)  # 4 rows: the packed weight
        torch.testing.assert_close(layer(x4), torch.nn.functional.linear(x4, layer.weight, layer.bias))
        assert weight.packed is not None
        layer(torch.randn(1, 2, 16, generator=g))  # 2 rows: never measured, so measured now
    assert set(packed_mod.CHOICE) == {(16, 8, 1), (16, 8, 2), (16, 8, 4)}
    assert packed_mod.CHOICE[(16, 8, 2)] in (True, False, packed_mod.COLUMNS)


def test_a_servers_packing_keeps_a_rows_answer_whoever_is_batched_beside_it(parts, monkeypatch):
    # the property a server batching several owners' decode steps needs: owner A's answer is the
    # same alone or beside owner B's rows; addmm's is not (another kernel for another row count)
    import splitlearn.model.packed as packed_mod

    monkeypatch.setattr(packed_mod, "CHOICE", {})  # an adaptive packer would measure and may pick addmm
    trunk = parts.trunk.eval()
    layer = trunk.h[0].mlp.c_fc
    x = torch.randn(4, 1, layer.weight.shape[0], generator=torch.Generator().manual_seed(7))
    packed = PackedLinears(trunk, adaptive=False)
    with torch.no_grad(), packed.active():
        together = layer(x)
        alone = [layer(x[i:i + 1]) for i in range(4)]
    assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(4))
    assert packed_mod.CHOICE == {}  # nothing was measured: every product went packed


def test_a_linear_layers_in_out_copy_gives_its_products_and_follows_the_weight(monkeypatch):
    """The third choice (an ``nn.Linear``'s weight copied (in, out), MKL's fast few-row path):
    its products are the layer's within float32 rounding, it is made again after an optimizer
    step, and it is not kept where no size of the shape chose it."""
    import splitlearn.model.packed as packed_mod

    monkeypatch.setattr(packed_mod, "CHOICE", {(16, 40, 1): packed_mod.COLUMNS, (16, 40, 4): True})
    layer = torch.nn.Linear(16, 40).eval()
    packed = PackedLinears(torch.nn.Sequential(layer))
    columns = packed._weights[0].columns()
    g = torch.Generator().manual_seed(5)
    x1 = torch.randn(1, 1, 16, generator=g)
    with torch.no_grad(), packed.active():
        torch.testing.assert_close(layer(x1), torch.nn.functional.linear(x1, layer.weight, layer.bias))
        assert columns.copy is not None and columns.copy.shape == (16, 40)
        with torch.no_grad():
            layer.weight.mul_(-2.0)  # what an optimizer step does: the version counter moves
        torch.testing.assert_close(layer(x1), torch.nn.functional.linear(x1, layer.weight, layer.bias))
        torch.testing.assert_close(columns.copy, layer.weight.t())
    # a shape measured now (CHOICE empty) keeps the copy only if some size chose it
    monkeypatch.setattr(packed_mod, "CHOICE", {})
    other = torch.nn.Linear(8, 24).eval()
    packed = PackedLinears(torch.nn.Sequential(other))
    with torch.no_grad(), packed.active():
        y = other(torch.randn(1, 8, generator=g))
    choice = packed_mod.CHOICE[(8, 24, 1)]
    assert choice in (True, False, packed_mod.COLUMNS) and y.shape == (1, 24)
    assert (packed._weights[0].columns().copy is not None) == (choice == packed_mod.COLUMNS)


class _AlwaysOwn(dict):
    def get(self, key, default=None):
        return False


@pytest.mark.parametrize("tenants", [1, 2])
def test_a_one_tenant_servers_decode_takes_the_fastest_product_and_a_shared_ones_the_packed(tenants, monkeypatch):
    """Batch invariance protects one owner's answers from the others batched beside it: a
    server of several tenants packs every decode product; with one tenant there is no other
    owner, and each product runs where it measured fastest (here: forced to the layer's own,
    the unsplit model's bits)."""
    import splitlearn.model.packed as packed_mod
    from serverproc import TENANTS
    from splitlearn.server import ServerConfig, create_app

    monkeypatch.setattr(packed_mod, "CHOICE", _AlwaysOwn())
    rt = create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS[:tenants])).extensions["splitlearn"]
    assert rt._packed.adaptive == (tenants == 1)
    trunk = rt.segment.eval()
    x = torch.randn(1, 1, trunk.config.n_embd, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = trunk(x, None, trunk.new_cache())
        with rt.inference():
            served = trunk(x, None, trunk.new_cache())
    packed_any = any(p.packed is not None for p in rt._packed._weights)
    assert packed_any == (tenants > 1)  # one tenant: the layers' own products, as forced
    if tenants == 1:
        assert torch.equal(served, plain)
    else:
        torch.testing.assert_close(served, plain, atol=1e-5, rtol=1e-5)


def test_the_decode_products_benchmark_runs_both_rules(tmp_path, monkeypatch):
    """``benchmarks/decode_products.py --quick``: the unsplit step and both servers' rules, timed."""
    import json
    import sys
    from pathlib import Path

    from splitlearn.procs import localserver

    # a process of its own (it pins its core and sets the products' choices), forked from the tests'
    # preloaded interpreter where it can be (tests/forkserver.py: not ~9 CPU-seconds of imports)
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "dp.json"
    monkeypatch.chdir(root)  # python -m benchmarks.decode_products
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = localserver.launch([sys.executable, "-m", "benchmarks.decode_products", "--quick", "--out", str(out)],
                                  stdout=stdout, stderr=stderr)
        try:
            code = proc.wait(120)
        finally:
            proc.kill()
    assert code == 0, (tmp_path / "stderr").read_text()[-3000:]
    res = json.loads(out.read_text())
    assert set(res["median_ms"]) == {"unsplit", "shared", "one tenant"} and all(v > 0 for v in res["median_ms"].values())
    assert res["head_choice"]["shared"] in ("True", "False")  # the earlier rule has no (in, out) copy
