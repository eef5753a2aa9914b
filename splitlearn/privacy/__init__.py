"""Privacy of split learning: what the server reads back from the activations (:mod:`.meter`,
:mod:`.attacks`), client-side defenses (:mod:`.defenses`), their DP accounting (:mod:`.accounting`) and the
recommended preset (:mod:`.presets`). Defense-aware fine-tuning, which runs through the model
classes, is one layer up: :mod:`splitlearn.defensetrain`. See docs/PRIVACY.md."""
from .accounting import gaussian_epsilon
from .attacks import ATTACKS, AttackConfig
from .defenses import (Defense, GaussianNoise, GaussianNoPeek, NoPeek, distance_correlation, make_defense,
                       parse_defense)
from .meter import LeakageReport, measure_leakage, split_corpus
from .presets import Preset, recommended
from .reference import train_reference

__all__ = ["ATTACKS", "AttackConfig", "Defense", "GaussianNoPeek", "GaussianNoise", "LeakageReport", "NoPeek",
           "Preset", "distance_correlation", "gaussian_epsilon", "make_defense", "measure_leakage",
           "parse_defense", "recommended", "split_corpus", "train_reference"]
