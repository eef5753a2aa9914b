"""Privacy of split learning: what the server reads back from the activations (:mod:`.meter`,
:mod:`.attacks`), client-side defenses (:mod:`.defenses`) and their DP accounting
(:mod:`.accounting`). See docs/PRIVACY.md."""
from .accounting import gaussian_epsilon
from .attacks import ATTACKS, AttackConfig
from .defenses import Defense, GaussianNoise, NoPeek, distance_correlation, make_defense
from .meter import LeakageReport, measure_leakage, split_corpus
from .reference import train_reference

__all__ = ["ATTACKS", "AttackConfig", "Defense", "GaussianNoise", "LeakageReport", "NoPeek",
           "distance_correlation", "gaussian_epsilon", "make_defense", "measure_leakage",
           "split_corpus", "train_reference"]
