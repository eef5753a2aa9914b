"""measure_leakage on the tiny model: recovery, the labels of the 2-way split, perplexity
with and without a defense, epsilon, bad input; the cached reference training."""
import json
import math

import pytest
import torch

from splitlearn import load_model
from splitlearn.errors import ConfigError
from splitlearn.privacy import AttackConfig, GaussianNoise, measure_leakage, train_reference
from splitlearn.privacy.reference import reference_info

FAST = dict(attacks=("linear", "whitebox"), seq_len=16, max_private_tokens=256,
            config=AttackConfig(epochs=20))


def test_shallow_cut_leaks_without_defense(tiny_model):
    r = measure_leakage(tiny_model, 1, **FAST)
    assert r.token_recovery >= 0.9 and r.best_attack in ("linear", "whitebox")
    assert r.attacks["whitebox"] == 1.0  # the weights are known: exact inversion
    assert r.labels_reach_server and r.training_token_recovery == 1.0
    assert any("labels" in n for n in r.notes)
    assert r.perplexity == pytest.approx(r.perplexity_unsplit, rel=1e-5)  # nothing changed
    assert r.epsilon is None and r.private_tokens == 256
    json.dumps(r.as_dict())


def test_u_shape_keeps_the_labels(tiny_model):
    r = measure_leakage(tiny_model, (2, 3), **FAST)
    assert not r.labels_reach_server and r.training_token_recovery == r.token_recovery
    assert r.cut == (2, 3) and r.as_dict()["cut"] == [2, 3]


def test_noise_lowers_recovery_and_costs_perplexity(tiny_model):
    clean = measure_leakage(tiny_model, 1, **FAST)
    d = GaussianNoise(sigma=4.0, clip=0.15)
    noisy = measure_leakage(tiny_model, 1, defense=d, delta=1e-6, **FAST)
    assert noisy.token_recovery < clean.token_recovery - 0.5
    assert noisy.perplexity != pytest.approx(noisy.perplexity_unsplit, rel=1e-3)
    assert noisy.epsilon == pytest.approx(d.epsilon(1e-6, tokens=16)) and noisy.releases == 16
    assert noisy.defense == {"name": "gaussian", "sigma": 4.0, "clip": 0.15}
    clipped = measure_leakage(tiny_model, 1, defense=GaussianNoise(0.0, 0.15), **FAST)
    assert clipped.as_dict()["epsilon"] == "inf"


@pytest.mark.parametrize("kw,match", [
    (dict(cut=5), "out of range"),
    (dict(cut=(3, 1)), "sorted"),
    (dict(cut=1, attacks=("linear", "oracle")), "unknown attack 'oracle'"),
    (dict(cut=1, seq_len=65), "seq_len"),
    (dict(cut=1, defense="noise"), "defense must be"),
])
def test_bad_input(tiny_model, kw, match):
    with pytest.raises(ConfigError, match=match):
        measure_leakage(tiny_model, **kw)


def test_reference_training_is_cached(tmp_path):
    p = train_reference("tiny", steps=3, batch_size=2, seq_len=16, cache_dir=tmp_path, progress=False)
    info = reference_info(p)
    assert info["steps"] == 3 and math.isfinite(info["private_loss"])
    stamp = (p / "train.json").stat().st_mtime_ns
    assert train_reference("tiny", steps=3, batch_size=2, seq_len=16, cache_dir=tmp_path,
                           progress=False) == p
    assert (p / "train.json").stat().st_mtime_ns == stamp  # loaded, not retrained
    trained, fresh = load_model(p), load_model("tiny")
    assert not torch.equal(trained.transformer.wte.weight, fresh.transformer.wte.weight)
    with pytest.raises(ConfigError, match="steps"):
        train_reference("tiny", steps=0, cache_dir=tmp_path)
