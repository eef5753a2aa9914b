"""The gradient channel's defense (GaussianNoise(grad_clip=..., grad_sigma=...)): the gradient a
U-shape client sends back at the second cut is clipped per token and noised, as documented, by the
model classes and by the meter alike; nothing changes without it; its epsilon; bad input; training
still learns with moderate noise."""
import math

import dp_accounting
import pytest
import torch

from splitlearn.errors import ConfigError
from splitlearn.privacy import GaussianNoise, gaussian_epsilon
from splitlearn.defense.defenses import parse_defense

CUT = (1, 3)


def _g(seed=0, shape=(4, 16, 32), scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _summed(g):  # the units of grad_clip: the gradient of the loss summed over B * (T - 1) tokens
    return g * (g.shape[0] * (g.shape[1] - 1))


# -- the tensor op ---------------------------------------------------------------------------------


def test_defend_gradient_clips_every_token_and_keeps_small_ones():
    d = GaussianNoise(sigma=1.0, clip=1.0, grad_sigma=0.0, grad_clip=5.5)  # per-token norms ~ sqrt(32)
    g = _g() / 60  # mean-loss units: B * (T - 1) = 60
    sent = d.defend_gradient(g)
    norms, before = _summed(sent).norm(dim=-1), _summed(g).norm(dim=-1)
    assert norms.max() <= 5.5 * (1 + 1e-5)
    small = before < 5.5
    assert small.any() and (~small).any()
    assert torch.allclose(sent[small], g[small], atol=1e-7)  # below the bound: unchanged
    assert torch.allclose(norms[~small], torch.full_like(norms[~small], 5.5), atol=1e-4)


def test_defend_gradient_noise_std_is_grad_sigma_times_grad_clip_and_reproducible():
    d = GaussianNoise(sigma=1.0, clip=1.0, grad_sigma=3.0, grad_clip=0.5)
    g = _g(shape=(8, 33, 64)) / 1e3
    clipped = GaussianNoise(1.0, 1.0, grad_sigma=0.0, grad_clip=0.5).defend_gradient(g)
    a = d.defend_gradient(g, generator=torch.Generator().manual_seed(1))
    b = d.defend_gradient(g, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    noise = _summed(a - clipped)
    assert noise.std().item() == pytest.approx(3.0 * 0.5, rel=0.03)
    assert abs(noise.mean().item()) < 0.03
    assert not torch.allclose(a, clipped)


def test_without_the_option_nothing_changes():
    g = _g()
    for d in (GaussianNoise(2.0, 1.0), GaussianNoise(2.0, 1.0, residual=True), GaussianNoise(2.0, 1.0, grad_sigma=0)):
        assert not d.defends_gradient
        assert d.defend_gradient(g) is g
        assert d.gradient_epsilon(1e-5) is None and math.isinf(d.training_epsilon(1e-5))
        assert "grad_sigma" not in d.describe() and "grad_clip" not in d.describe()
    d = GaussianNoise(2.0, 1.0, grad_sigma=1.0, grad_clip=0.5)
    assert d.describe()["grad_sigma"] == 1.0 and d.describe()["grad_clip"] == 0.5
    assert parse_defense("gaussian:sigma=2,residual=1,grad_sigma=1,grad_clip=0.5", clip=1.0) == \
        GaussianNoise(2.0, 1.0, residual=True, grad_sigma=1.0, grad_clip=0.5)


def test_gradient_epsilon_equals_the_library_and_composes():
    d = GaussianNoise(sigma=4.0, clip=1.0, grad_sigma=2.0, grad_clip=0.5)
    assert d.gradient_epsilon(1e-5, steps=3, tokens=32) == pytest.approx(gaussian_epsilon(1.0, 96, 1e-5))
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 32),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 32)])
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(event)
    both = d.training_epsilon(1e-5, tokens=32)
    assert both == pytest.approx(acc.get_epsilon(1e-5))
    assert both > max(d.epsilon(1e-5, tokens=32), d.gradient_epsilon(1e-5, tokens=32))
    assert math.isinf(GaussianNoise(4.0, 1.0, grad_sigma=0.0, grad_clip=0.5).gradient_epsilon(1e-5))


@pytest.mark.parametrize("make,match", [
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=-1.0, grad_clip=1.0), "grad_sigma"),
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=float("nan"), grad_clip=1.0), "grad_sigma"),
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=1.0, grad_clip=0.0), "grad_clip"),
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=1.0, grad_clip=float("inf")), "grad_clip"),
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=1.0), "needs grad_clip"),
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=True, grad_clip=1.0), "grad_sigma"),
    (lambda: parse_defense("gaussian:sigma=1,grad_sigma=2", clip=1.0), "needs grad_clip"),
    (lambda: parse_defense("gaussian:sigma=1,grad_sigma=x,grad_clip=1", clip=1.0), "must be a number"),
    (lambda: parse_defense("nopeek:weight=1,grad_sigma=1,grad_clip=1"), "no field 'grad_clip'"),
    (lambda: GaussianNoise(1.0, 1.0, grad_sigma=1.0, grad_clip=1.0).gradient_epsilon(1e-5, steps=0), "steps"),
])
def test_bad_input(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


# -- through the model classes ---------------------------------------------------------------------


def _sent_gradients(model, ids):
    """The gradients the client sends the server in one training backward (the wire's messages)."""
    sent, remote = [], model.remote
    real = remote.steps.send_backward

    def record(piece, grad, dtype, device):
        sent.append(grad.detach().clone())
        return real(piece, grad, dtype, device)

    remote.steps.send_backward = record
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        del remote.steps.send_backward
    model.zero_grad()
    assert len(sent) == 1
    return sent[0]  # (B, T, d)


def _ids():
    from splitlearn.model.data import ByteTokenizer
    from splitlearn.privacy.meter import split_corpus, windows

    return windows(ByteTokenizer(), split_corpus()[0], 16)[:4]  # (4, 16)


def test_the_server_receives_the_clipped_noised_gradient(tiny_model):
    from serverproc import InprocServerProcess

    from splitlearn.hf.modeling import SplitGPT2LMHeadModel
    from splitlearn.privacy.meter import cut_gradients

    ids = _ids()
    loose = dict(sigma=0.0, clip=1e6)  # the first cut untouched: comparable gradients
    with InprocServerProcess(CUT, lr=1e-9) as srv:
        m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=srv.token)
        m.eval()
        clean = _sent_gradients(m, ids)
        m.defense = GaussianNoise(**loose)
        assert torch.equal(_sent_gradients(m, ids), clean)  # no gradient option: unchanged
        summed = _summed(clean).norm(dim=-1)[:, :-1]  # the last position has no label: 0
        c = summed.median().item()
        m.defense = GaussianNoise(**loose, grad_sigma=0.0, grad_clip=c)
        clipped = _sent_gradients(m, ids)
        assert _summed(clipped).norm(dim=-1).max() <= c * (1 + 1e-4)
        assert not torch.allclose(clipped, clean)
        # the meter's gradients are the model classes' (the same clip, in the summed units)
        meter = cut_gradients(tiny_model, CUT, ids, GaussianNoise(**loose, grad_sigma=0.0, grad_clip=c))
        assert torch.allclose(meter, _summed(clipped), atol=1e-4 * c)
        torch.manual_seed(0)
        m.defense = GaussianNoise(**loose, grad_sigma=2.0, grad_clip=c)
        noised = _sent_gradients(m, ids)
        noise = _summed(noised - clipped)
        assert noise.std().item() == pytest.approx(2.0 * c, rel=0.05)
        # the residual design: the server still gets the clipped gradient
        m.defense = GaussianNoise(**loose, residual=True, grad_sigma=0.0, grad_clip=c)
        assert torch.allclose(_sent_gradients(m, ids), clipped, atol=1e-6)
        with pytest.raises(ConfigError, match="micro_batches"):
            m.micro_batches = 2
        m.remote.close()


def test_the_gradient_defense_needs_a_u_shape(tiny_model):
    from serverproc import InprocServerProcess

    from splitlearn.hf.modeling import SplitGPT2LMHeadModel
    from splitlearn.privacy import measure_leakage

    d = GaussianNoise(1.0, 1.0, grad_sigma=1.0, grad_clip=1.0)
    with pytest.raises(ConfigError, match="U-shape"):
        measure_leakage(tiny_model, 2, defense=d, attacks=("linear",))
    with InprocServerProcess((2,)) as srv:
        m = SplitGPT2LMHeadModel.from_pretrained("tiny", server=srv.url, token=srv.token)
        with pytest.raises(ConfigError, match="U-shape"):
            m.defense = d
        m.defense = GaussianNoise(1.0, 1.0)  # the activations' defense alone is fine
        m.remote.close()


def test_training_still_learns_with_moderate_gradient_noise(tmp_path, tiny_model):
    from splitlearn.model.data import ByteTokenizer
    from splitlearn.apps.defensetrain import finetune_defense, finetune_info
    from splitlearn.privacy.meter import median_token_norm

    clip = median_token_norm(tiny_model, CUT, tokenizer=ByteTokenizer(), seq_len=16)
    d = GaussianNoise(sigma=0.5, clip=clip, residual=True, grad_sigma=1.0, grad_clip=1.0)
    path = finetune_defense("tiny", CUT, d, 12, cache_dir=tmp_path, batch_size=4, seq_len=16, lr=3e-3,
                            progress=False)
    info = finetune_info(path)
    assert info["defense"] == d.describe() and info["defense"]["grad_sigma"] == 1.0
    assert info["loss_last"] < info["loss_first"]


# -- the recommended preset's gradient clip follows the model ---------------------------------------


def test_recommended_grad_clip_is_the_median_gradient_norm_and_an_explicit_one_wins(tmp_path, tiny_model):
    """``--defense recommended`` clips the gradient at the second cut to its median per-token norm
    on public text (as its activation clip is the median activation norm); a spec's own grad_clip
    is kept as given."""
    import json

    from splitlearn.privacy import Preset, recommended
    from splitlearn.privacy.cli import main as meter_main
    from splitlearn.privacy.meter import (cut_gradients, default_tokenizer, median_token_grad_norm, split_corpus,
                                          windows)

    med = median_token_grad_norm(tiny_model, CUT, seq_len=16)
    assert med > 0
    # the median of the per-token norms of the (undefended) gradient, the last position excluded
    ids = windows(default_tokenizer(tiny_model), split_corpus()[0], 16)
    g = cut_gradients(tiny_model, CUT, ids, None)
    assert med == pytest.approx(g[:, :-1].norm(dim=-1).median().item())
    out = tmp_path / "out.json"
    assert meter_main(["--model", "tiny", "--cut", "1,3", "--defense", "recommended",
                       "--defense", "gaussian:sigma=4,residual=1,grad_sigma=2,grad_clip=0.123",
                       "--defense-train-steps", "0", "--attacks", "linear", "--epochs", "1", "--seq-len", "16",
                       "--max-private-tokens", "32", "--no-progress", "--json", str(out)]) == 0
    none, rec, mine = json.loads(out.read_text())["rows"]
    assert rec["preset"] == "recommended" and rec["defense"]["grad_clip"] == pytest.approx(med)
    assert rec["defense"]["grad_sigma"] == 2.0
    assert mine["defense"]["grad_clip"] == pytest.approx(0.123)  # the user's spec wins
    # the library: the preset takes the measured clip, and a preset that fixes grad_clip keeps it
    assert recommended("u", CUT).defense(clip=1.0, grad_clip=med).grad_clip == med
    fixed = Preset("u", CUT, "gaussian:sigma=4,residual=1,grad_sigma=2,grad_clip=1", 0, "")
    assert fixed.defense(clip=1.0, grad_clip=med).grad_clip == 1.0
