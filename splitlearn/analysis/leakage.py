"""``--privacy``: token recovery and perplexity per cut next to the cost, and the cheapest cut
that keeps leakage under ``--max-leakage`` (docs/PRIVACY.md, 'Choosing a cut')."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class PrivacyConfig:
    """What the meter measures and the bound the recommendation must meet."""

    sigmas: tuple[float, ...] = ()       # GaussianNoise noise multipliers to try (plus none)
    clip: Optional[float] = None         # per-token L2 clip (None: median norm at each cut)
    max_leakage: Optional[float] = None  # highest token recovery allowed, in [0, 1]
    seq_len: int = 32                    # tokens per window of the meter
    attacks: tuple[str, ...] = ("linear", "mlp", "gru", "whitebox")
    epochs: int = 30                     # learned inverters' training epochs
    max_private_tokens: Optional[int] = None  # tokens to recover at most (speed)
    seed: int = 0

    def __post_init__(self):
        self.sigmas = tuple(self.sigmas)
        self.attacks = tuple(self.attacks)
        if self.max_leakage is not None and not 0 <= self.max_leakage <= 1:
            raise ConfigError(f"max_leakage must lie in [0, 1], got {self.max_leakage}")
        from ..privacy import AttackConfig, GaussianNoise
        from ..privacy.attacks import check_attacks
        check_attacks(self.attacks)
        for s in self.sigmas:
            GaussianNoise(sigma=s, clip=1.0 if self.clip is None else self.clip)  # validates both
        AttackConfig(epochs=self.epochs)


class Meter:
    """Measures each (first cut, sigma) once; rows are LeakageReport dicts."""

    def __init__(self, model, pconf: PrivacyConfig):
        self.model, self.pconf = model, pconf
        self.cache: dict[tuple, dict] = {}
        self.clips: dict[int, float] = {}

    def rows(self, cut: tuple[int, ...]) -> list[dict]:
        """No defense, then one row per sigma, for ``cut`` (leakage depends on cut[0] and on
        whether it is a 2-way split)."""
        from ..privacy import AttackConfig, GaussianNoise, measure_leakage
        from ..privacy.meter import median_token_norm
        out = []
        for sigma in (None, *self.pconf.sigmas):
            key = (cut[0], sigma)  # the same first cut sends the same activations
            if key not in self.cache:
                defense = None
                if sigma is not None:
                    clip = self.pconf.clip
                    if clip is None:
                        if cut[0] not in self.clips:
                            self.clips[cut[0]] = median_token_norm(self.model, cut,
                                                                   seq_len=self.pconf.seq_len)
                        clip = self.clips[cut[0]]
                    defense = GaussianNoise(sigma=sigma, clip=clip)
                r = measure_leakage(self.model, cut, defense=defense, seq_len=self.pconf.seq_len,
                                    attacks=self.pconf.attacks,
                                    config=AttackConfig(epochs=self.pconf.epochs, seed=self.pconf.seed),
                                    max_private_tokens=self.pconf.max_private_tokens,
                                    seed=self.pconf.seed)
                self.cache[key] = r.as_dict()
            row = dict(self.cache[key], cut=list(cut), labels_reach_server=len(cut) == 1)
            row["training_token_recovery"] = 1.0 if len(cut) == 1 else row["token_recovery"]
            row["notes"] = [n for n in row["notes"] if "labels" not in n]
            if len(cut) == 1:
                row["notes"].append("2-way split: during training the labels, which are the input "
                                    "text itself, are sent to the server")
            out.append(row)
        return out


def leakage(row: dict, mode: str) -> float:
    """What the server learns of the text: 1.0 for a 2-way cut in train mode (labels)."""
    if mode == "train" and row["labels_reach_server"]:
        return 1.0
    return row["token_recovery"]


def _summary(row: dict, mode: str) -> dict:
    return {"defense": row["defense"], "token_recovery": row["token_recovery"],
            "best_attack": row["best_attack"], "leakage": leakage(row, mode),
            "perplexity": row["perplexity"], "perplexity_unsplit": row["perplexity_unsplit"],
            "epsilon": row["epsilon"]}


def annotate_sweep(sweep: dict, model, pconf: PrivacyConfig, meter: Optional[Meter] = None) -> dict:
    """Add "privacy" (one summary per defense strength) to every 2-way and U-shape point of
    ``sweep`` and, given ``max_leakage``, "private_recommendation"; returns ``sweep``."""
    meter = meter or Meter(model, pconf)
    mode = sweep["mode"]
    for p in sweep["points"]:
        p["privacy"] = [_summary(r, mode) for r in meter.rows((p["cut"],))]
    for p in sweep.get("u_points", []):
        p["privacy"] = [_summary(r, mode) for r in meter.rows(tuple(p["cuts"]))]
    if pconf.max_leakage is not None:
        sweep["private_recommendation"] = recommend_private(sweep, pconf.max_leakage)
    return sweep


def _cost(p: dict) -> tuple:
    return (round(p.get("step_ms", p["client_ms"]), 6), p["client_macs"])


def recommend_private(sweep: dict, max_leakage: float) -> dict:
    """The cheapest configuration (2-way or U-shape) with a defense whose leakage is at most
    ``max_leakage``, with the weakest such defense; cost: the estimated step time given a link,
    else the client's time."""
    options = []
    for p in sweep["points"] + sweep.get("u_points", []):
        ok = [s for s in p.get("privacy", []) if s["leakage"] <= max_leakage]
        if ok:
            options.append((p, min(ok, key=lambda s: s["perplexity"])))
    metric = "step_ms" if sweep["points"] and "step_ms" in sweep["points"][0] else "client_ms"
    if not options:
        return {"cuts": None, "reason": f"no cut and defense tried keeps token recovery <= "
                f"{max_leakage:g}; try a larger --noise-sigma"}
    p, s = min(options, key=lambda o: (_cost(o[0]), o[1]["perplexity"]))
    cuts = p.get("cuts", [p.get("cut")])
    d = s["defense"]
    dtext = "no defense" if d["name"] == "none" else f"GaussianNoise(sigma={d['sigma']:g}, clip={d['clip']:.3g})"
    shape = f"cut {cuts[0]}" if len(cuts) == 1 else f"U-shape {cuts[0]},{cuts[1]}"
    reason = (f"{shape} with {dtext}: token recovery {s['leakage']:.3f} <= {max_leakage:g}, "
              f"perplexity {s['perplexity']:.2f} (unsplit {s['perplexity_unsplit']:.2f}), "
              f"{metric} {p[metric]:.2f}; the cheapest of {len(options)} configurations that meet "
              f"the bound" + ("; 2-way cuts send the labels in training, so only U-shapes qualify"
                             if sweep["mode"] == "train" else ""))
    return {"cuts": cuts, "defense": d, metric: p[metric], "leakage": s["leakage"],
            "perplexity": s["perplexity"], "reason": reason}
