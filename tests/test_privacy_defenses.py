"""Defenses: clipping and noise as documented, differentiable, reproducible; epsilon equals
dp-accounting's own computation; NoPeek's distance correlation; bad input -> ConfigError."""
import math

import dp_accounting
import pytest
import torch

from splitlearn.errors import ConfigError
from splitlearn.privacy import (Defense, GaussianNoise, NoPeek, distance_correlation,
                                gaussian_epsilon, make_defense)


def _h(seed=0, scale=10.0, shape=(4, 16, 32)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_clip_bounds_every_token_and_keeps_small_ones():
    d = GaussianNoise(sigma=0.0, clip=3.0)
    h = _h()
    h[0, 0] = 0.1  # norm ~0.57 < clip: unchanged
    out = d.apply(h)
    norms = out.norm(dim=-1)
    assert norms.max() <= 3.0 + 1e-5
    assert torch.allclose(out[0, 0], h[0, 0])
    big = h.norm(dim=-1) > 3.0
    assert torch.allclose(norms[big], torch.full_like(norms[big], 3.0), atol=1e-5)
    # clipped vectors keep their direction
    cos = torch.nn.functional.cosine_similarity(out, h, dim=-1)
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-5)


def test_sensitivity_is_twice_the_clip():
    d = GaussianNoise(sigma=0.0, clip=2.0)
    a, b = d.apply(_h(1, 100.0)), d.apply(-_h(1, 100.0))  # opposite directions: the diameter
    assert torch.allclose((a - b).norm(dim=-1), torch.full(a.shape[:2], 4.0), atol=1e-4)
    assert d.noise_multiplier == 0.0 and GaussianNoise(sigma=3.0, clip=7.0).noise_multiplier == 1.5


def test_noise_std_is_sigma_times_clip_and_reproducible():
    d = GaussianNoise(sigma=0.5, clip=4.0)
    h = _h(2, 0.01, (8, 64, 32))  # below the clip: the output is h + noise
    out = d.apply(h, generator=torch.Generator().manual_seed(5))
    assert (out - h).std().item() == pytest.approx(2.0, rel=0.03)
    again = d.apply(h, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out, again)
    d.generator = torch.Generator().manual_seed(5)
    assert torch.equal(d.apply(h), out)  # the attribute is used when no argument is given


def test_apply_is_differentiable():
    d = GaussianNoise(sigma=1.0, clip=1.0, generator=torch.Generator().manual_seed(0))
    h = _h().requires_grad_()
    out = d.apply(h)
    out.backward(torch.ones_like(out))
    assert h.grad is not None and torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0


def test_identity_defenses():
    h = _h()
    assert torch.equal(NoPeek(0.5).apply(h), h) and torch.equal(Defense().apply(h), h)
    assert GaussianNoise(1.0, 1.0).loss(h, h) is None
    assert NoPeek(0.5).epsilon(1e-5) is None


@pytest.mark.parametrize("sigma,tokens,steps,accountant", [
    (1.0, 64, 1, "rdp"), (4.0, 128, 10, "rdp"), (20.0, 1, 1, "rdp"),
    (2.0, 4, 2, "pld"), (20.0, 1, 1, "pld")])  # PLD composition is slow for many releases
def test_epsilon_equals_the_library(sigma, tokens, steps, accountant):
    d = GaussianNoise(sigma=sigma, clip=3.0)
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / 2),
                                              tokens * steps)
    acc = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp"
           else dp_accounting.pld.PLDAccountant())
    acc.compose(event)
    assert d.epsilon(1e-5, steps=steps, tokens=tokens, accountant=accountant) == \
        pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_epsilon_behaves():
    # k Gaussian releases of multiplier z are one of multiplier z / sqrt(k): the library's
    # exact single-Gaussian formula (Balle & Wang 2018) agrees with the PLD composition
    z, k = 4.0, 16
    exact = dp_accounting.get_epsilon_gaussian(z / math.sqrt(k), 1e-5)
    assert gaussian_epsilon(z, k, 1e-5, "pld") == pytest.approx(exact, rel=0.02)
    eps = [GaussianNoise(s, 1.0).epsilon(1e-5, tokens=32) for s in (1.0, 2.0, 8.0)]
    assert eps[0] > eps[1] > eps[2] > 0
    assert GaussianNoise(0.0, 1.0).epsilon(1e-5) == math.inf
    assert GaussianNoise(2.0, 1.0).epsilon(1e-5, tokens=10) < GaussianNoise(2.0, 1.0).epsilon(1e-5, tokens=100)


def test_distance_correlation():
    x = _h(3, 1.0, (40, 5))
    assert distance_correlation(x, 3 * x + 1).item() == pytest.approx(1.0, abs=1e-4)
    indep = distance_correlation(x, _h(4, 1.0, (40, 5))).item()
    assert 0 < indep < 0.6
    z = x.clone().requires_grad_()
    distance_correlation(x, z).backward()
    assert torch.isfinite(z.grad).all()


def test_nopeek_loss_units():
    x, h = _h(5, 1.0, (4, 6, 8)), _h(6, 1.0, (4, 6, 8))
    seq = NoPeek(weight=2.0).loss(x, h)
    tok = NoPeek(weight=2.0, unit="token").loss(x, h)
    assert seq.item() == pytest.approx(2 * distance_correlation(x.reshape(4, -1), h.reshape(4, -1)).item())
    assert tok.item() == pytest.approx(2 * distance_correlation(x.reshape(24, 8), h.reshape(24, 8)).item())
    assert NoPeek(weight=1.0).loss(x, x).item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("make,match", [
    (lambda: GaussianNoise(sigma=-1.0, clip=1.0), "sigma must be >= 0"),
    (lambda: GaussianNoise(sigma=1.0, clip=0.0), "clip must be > 0"),
    (lambda: GaussianNoise(sigma=1.0, clip=-2.0), "clip must be > 0"),
    (lambda: GaussianNoise(sigma="a", clip=1.0), "sigma must be a number"),
    (lambda: NoPeek(weight=-0.1), "weight"),
    (lambda: NoPeek(unit="batch"), "unit"),
    (lambda: make_defense("dropout"), "unknown defense 'dropout'"),
    (lambda: GaussianNoise(1.0, 1.0).epsilon(0.0), "delta"),
    (lambda: GaussianNoise(1.0, 1.0).epsilon(1e-5, steps=0), "steps"),
    (lambda: GaussianNoise(1.0, 1.0).epsilon(1e-5, accountant="moments"), "unknown accountant"),
])
def test_bad_input(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def _train_bottom(nopeek_weight, steps=40):
    """Train the tiny model's bottom (cut 1) with the LM loss (+ NoPeek); dCor at the end."""
    from splitlearn import load_model, partition
    torch.manual_seed(0)
    model = load_model("tiny").train()
    part = partition(model, 1)
    defense = NoPeek(weight=nopeek_weight, unit="token")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    held = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(99))

    def dcor():
        with torch.no_grad():
            e, h = part.bottom.wte(held), part.bottom(held)
            return distance_correlation(e.reshape(-1, 32), h.reshape(-1, 32)).item()

    start = dcor()
    for _ in range(steps):
        ids = torch.randint(0, 256, (8, 16), generator=gen)
        h = part.bottom(ids)
        loss = part.loss(ids) + defense.loss(part.bottom.wte(ids), h)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return start, dcor()


def test_nopeek_lowers_distance_correlation_over_training():
    start, plain = _train_bottom(0.0)
    _, nopeek = _train_bottom(1.0)
    assert nopeek < start - 0.1 and nopeek < plain - 0.1, (start, plain, nopeek)
