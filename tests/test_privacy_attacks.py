"""Attacks: learned inverters and white-box inversion read tokens back from a tiny model's
cut-layer activations; noise makes them fail; bad input -> ConfigError."""
import pytest
import torch

from splitlearn import ByteTokenizer, partition
from splitlearn.errors import ConfigError
from splitlearn.privacy import GaussianNoise
from splitlearn.privacy.attacks import (AttackConfig, bottom_activations, check_attacks,
                                        invert_learned, invert_whitebox, recovery, train_inverter)
from splitlearn.privacy.meter import split_corpus, windows

FAST = AttackConfig(epochs=30)


@pytest.fixture(scope="module")
def data():
    tok = ByteTokenizer()
    pub, priv = split_corpus()
    return windows(tok, pub, 16, 8), windows(tok, priv, 16)[:16]  # (Np, 16), (16, 16)


def _acts(model, cut, data):
    bottom = partition(model, cut).bottom
    return bottom, bottom_activations(bottom, data[0]), bottom_activations(bottom, data[1])


def test_whitebox_inverts_exactly_without_defense(tiny_model, data):
    bottom, _, h = _acts(tiny_model, 3, data)
    pred = invert_whitebox(bottom, h, torch.arange(257))
    assert torch.equal(pred, data[1])


def test_whitebox_per_position_candidates(tiny_model, data):
    bottom, _, h = _acts(tiny_model, 2, data)
    ids = data[1]
    wrong = (ids[..., None] + torch.tensor([1, 2, 3])) % 256  # (B, T, 3) all wrong
    cands = torch.cat([wrong, ids[..., None]], -1)  # the truth among them, last
    assert torch.equal(invert_whitebox(bottom, h, cands), ids)
    assert recovery(invert_whitebox(bottom, h, wrong), ids) == 0.0


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_learned_inverter_recovers_shallow_cut(tiny_model, data, kind):
    _, hp, hq = _acts(tiny_model, 1, data)
    classes = data[0].unique()
    inv = train_inverter(kind, hp, data[0], None, classes, FAST)
    assert recovery(invert_learned(inv, hq, classes), data[1]) >= 0.9
    top3 = invert_learned(inv, hq, classes, topk=3)
    assert top3.shape == (*data[1].shape, 3) and torch.equal(top3[..., 0], invert_learned(inv, hq, classes))


def test_gru_inverter_learns(tiny_model, data):
    _, hp, hq = _acts(tiny_model, 2, data)
    classes = data[0].unique()
    inv = train_inverter("gru", hp, data[0], None, classes, AttackConfig(epochs=30))
    assert recovery(invert_learned(inv, hq, classes), data[1]) >= 0.5  # chance is ~1/60


def test_recovery_falls_as_sigma_grows(tiny_model, data):
    bottom, hp, hq = _acts(tiny_model, 1, data)
    clip = hp.norm(dim=-1).median().item()
    classes = data[0].unique()
    rec = []
    for sigma in (0.0, 0.3, 1.0, 4.0):
        d = GaussianNoise(sigma=sigma, clip=clip)
        y = d.apply(hq, generator=torch.Generator().manual_seed(7))
        inv = train_inverter("mlp", hp, data[0], d, classes, FAST)  # adaptive: trained on noise
        learned = recovery(invert_learned(inv, y, classes), data[1])
        white = recovery(invert_whitebox(bottom, y, torch.arange(257), d), data[1])
        rec.append(max(learned, white))
    assert rec[0] >= 0.9
    assert rec[0] > rec[1] > rec[2] > rec[3], rec
    assert rec[3] < 0.25, rec


def test_bad_attack_input():
    with pytest.raises(ConfigError, match="unknown attack 'sipit'"):
        check_attacks(["linear", "sipit"])
    with pytest.raises(ConfigError, match="at least one"):
        check_attacks([])
    assert check_attacks("mlp") == ("mlp",)
    with pytest.raises(ConfigError, match="epochs"):
        AttackConfig(epochs=0)
    with pytest.raises(ConfigError, match="unknown inverter"):
        train_inverter("cnn", torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.long), None,
                       torch.arange(3))


def test_optimisation_attack_inverts_jointly(tiny_model, data):
    """No defense, no prior (uniform start): optimising the relaxed tokens of all positions at
    once recovers most of them; the learned inverter's log-probs as prior keep it at least as good
    as that inverter under noise."""
    from splitlearn.privacy.attacks import invert_optimize, inverter_log_probs

    bottom, h_pub, h = _acts(tiny_model, 1, data)
    classes = data[0].unique()
    free = recovery(invert_optimize(bottom, h, classes, config=AttackConfig(opt_steps=150)), data[1])
    assert free >= 0.95
    d = GaussianNoise(sigma=1.0, clip=0.3)
    inv = train_inverter("linear", h_pub, data[0], d, classes, FAST)
    y = d.apply(h, generator=torch.Generator().manual_seed(5))
    alone = recovery(invert_learned(inv, y, classes), data[1])
    both = recovery(invert_optimize(bottom, y, classes, d, inverter_log_probs(inv, y)), data[1])
    assert both >= alone - 0.05
    assert "optimize" in check_attacks(("optimize",))
    with pytest.raises(ConfigError, match="opt_steps"):
        AttackConfig(opt_steps=0)
