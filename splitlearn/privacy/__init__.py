"""Privacy of split learning, measured: what the server reads back from the activations (:mod:`.meter`,
:mod:`.attacks`) and the recommended preset (:mod:`.presets`). The client-side defenses and their DP
accounting are a floor down (:mod:`splitlearn.defense`: the model classes apply them; their names are
also here). Defense-aware fine-tuning, which runs through the model classes and a server, is an
application: :mod:`splitlearn.apps.defensetrain`. See docs/PRIVACY.md."""
from ..defense.accounting import gaussian_epsilon
from .attacks import ATTACKS, AttackConfig
from ..defense.defenses import (Defense, GaussianNoise, GaussianNoPeek, NoPeek, distance_correlation, make_defense,
                       parse_defense)
from .meter import LeakageReport, measure_leakage, split_corpus
from .presets import Preset, recommended
from .reference import train_reference

__all__ = ["ATTACKS", "AttackConfig", "Defense", "GaussianNoPeek", "GaussianNoise", "LeakageReport", "NoPeek",
           "Preset", "distance_correlation", "gaussian_epsilon", "make_defense", "measure_leakage",
           "parse_defense", "recommended", "split_corpus", "train_reference"]
