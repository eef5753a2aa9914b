"""``--privacy``: token recovery and perplexity per cut next to the cost, and the cheapest cut
that keeps leakage under ``--max-leakage`` (docs/PRIVACY.md, 'Choosing a cut')."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

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
    rows: tuple[dict, ...] = ()          # measured rows (load_rows: the meter's --json), used
                                         # instead of measuring at the cuts they cover

    def __post_init__(self):
        self.sigmas = tuple(self.sigmas)
        self.rows = tuple(self.rows)
        self.attacks = tuple(self.attacks)
        if self.max_leakage is not None and not 0 <= self.max_leakage <= 1:
            raise ConfigError(f"max_leakage must lie in [0, 1], got {self.max_leakage}")
        from ..privacy import AttackConfig, GaussianNoise
        from ..privacy.attacks import check_attacks
        check_attacks(self.attacks)
        for s in self.sigmas:
            GaussianNoise(sigma=s, clip=1.0 if self.clip is None else self.clip)  # validates both
        AttackConfig(epochs=self.epochs)


ROW_FIELDS = ("cut", "defense", "token_recovery", "best_attack", "perplexity")


def load_rows(sources, model: Optional[str] = None) -> tuple[dict, ...]:
    """The rows of ``python -m splitlearn.privacy --json`` files (a path, its parsed data, a list
    of rows, or a list of paths) for the planner: rows measured by the meter, e.g. with defenses
    fine-tuned in (``--defense-train-steps``). Rows where the attacker knew the public weights only
    (``attacker_knows: public``) are left out: the planner assumes the attacker knows the
    client's weights. The same (cut, defense, fine-tuning steps) in several rows is one row with
    the highest recoveries of them (e.g. one file measured the gradient channel, another not).
    ``model``: the analysed model; each file must be of the same one. Raises
    :class:`ConfigError` on a file without rows or rows without the fields the planner reads."""
    if isinstance(sources, (list, tuple)) and sources and all(isinstance(x, (str, Path)) for x in sources):
        rows = [r for src in sources for r in _load_rows(src, model)]
    else:
        rows = _load_rows(sources, model)
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (tuple(r["cut"]), json.dumps(r["defense"], sort_keys=True), r.get("finetune_steps") or 0)
        if key not in merged:
            merged[key] = r
            continue
        old = merged[key]
        grads = [g for g in (old.get("token_recovery_gradient"), r.get("token_recovery_gradient"))
                 if g is not None]
        keep = dict(r if r["token_recovery"] > old["token_recovery"] else old)
        keep["token_recovery_gradient"] = max(grads) if grads else None
        merged[key] = keep
    return tuple(merged.values())


def _load_rows(source, model: Optional[str]) -> list[dict]:
    data = source
    if isinstance(source, (str, Path)):
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read privacy rows from {source}: {e}") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise ConfigError("the privacy rows file has no rows (write it with python -m splitlearn.privacy --json)")
    if isinstance(data, dict) and model is not None and data.get("model") not in (None, model):
        raise ConfigError(f"the privacy rows were measured on {data.get('model')!r}, the analysis is of "
                          f"{model!r}")
    for r in rows:
        missing = [f for f in ROW_FIELDS if not isinstance(r, dict) or f not in r]
        if missing:
            raise ConfigError(f"a privacy row lacks {', '.join(missing)}")
    return [dict(r, source="file") for r in rows if r.get("attacker_knows", "finetuned") != "public"]


def describe_defense(d: dict, steps: int = 0) -> str:
    """A row's defense in words: ``GaussianNoise(sigma=4, clip=2.4, residual), fine-tuned 200 steps``."""
    if d["name"] == "none":
        text = "no defense"
    else:
        fields = [f"{k}={d[k]:.3g}" if k == "clip" else f"{k}={d[k]:g}"
                  for k in ("sigma", "clip", "weight") if k in d]
        fields += ["residual"] if d.get("residual") else []
        text = f"{d['name']}({', '.join(fields)})"
    return text + (f", fine-tuned {steps} steps with it" if steps else "")


class Meter:
    """Measures each (first cut, sigma) once; rows are LeakageReport dicts."""

    def __init__(self, model, pconf: PrivacyConfig):
        self.model, self.pconf = model, pconf
        self.cache: dict[tuple, dict] = {}
        self.clips: dict[int, float] = {}

    def rows(self, cut: tuple[int, ...]) -> list[dict]:
        """No defense, then one row per sigma, for ``cut`` (leakage depends on cut[0] and on
        whether it is a 2-way split); the given rows (``PrivacyConfig.rows``) of exactly ``cut``
        instead, when there are any (a fine-tuned row holds for its own cuts only)."""
        from ..privacy import AttackConfig, GaussianNoise, measure_leakage
        from ..privacy.meter import median_token_norm
        given = [dict(r) for r in self.pconf.rows if tuple(r["cut"]) == tuple(cut)]
        if given:
            return given
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
    """What the server learns of the text: 1.0 for a 2-way cut in train mode (labels); in train
    mode a U-shape row's gradient channel counts too, when it was measured."""
    if mode == "train" and row.get("labels_reach_server", len(row["cut"]) == 1):
        return 1.0
    grad = row.get("token_recovery_gradient")
    if mode == "train" and grad is not None:
        return max(row["token_recovery"], grad)
    return row["token_recovery"]


def _summary(row: dict, mode: str) -> dict:
    return {"defense": row["defense"], "token_recovery": row["token_recovery"],
            "best_attack": row["best_attack"], "leakage": leakage(row, mode),
            "perplexity": row["perplexity"],
            "perplexity_unsplit": row.get("perplexity_unsplit", row.get("perplexity_undefended")),
            "epsilon": row.get("epsilon"), "defense_trained": bool(row.get("defense_trained")),
            "finetune_steps": row.get("finetune_steps") or 0, "preset": row.get("preset"),
            "token_recovery_gradient": row.get("token_recovery_gradient"),
            "source": row.get("source", "measured")}


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
        # U-shape rows whose activations meet the bound but whose gradient channel does not
        by_grad = [s for p in sweep.get("u_points", []) for s in p.get("privacy", [])
                   if s["token_recovery"] <= max_leakage and s["leakage"] > max_leakage]
        hint = "try a larger --noise-sigma"
        if sweep["mode"] == "train" and by_grad:
            hint = (f"{len(by_grad)} U-shape rows meet it on their activations but give the labels away "
                    f"through the gradient at the second cut (recovery up to "
                    f"{max(s['leakage'] for s in by_grad):.3f}): no defense of the gradient exists yet")
        return {"cuts": None, "reason": f"no cut and defense tried keeps token recovery <= "
                f"{max_leakage:g}; {hint}"}
    p, s = min(options, key=lambda o: (_cost(o[0]), o[1]["perplexity"]))
    cuts = p.get("cuts", [p.get("cut")])
    d = s["defense"]
    dtext = describe_defense(d, s.get("finetune_steps") or 0)
    if s.get("preset"):
        dtext = f"the {s['preset']} preset, {dtext}"
    shape = f"cut {cuts[0]}" if len(cuts) == 1 else f"U-shape {cuts[0]},{cuts[1]}"
    reason = (f"{shape} with {dtext}: token recovery {s['leakage']:.3f} <= {max_leakage:g}, "
              f"perplexity {s['perplexity']:.2f} (unsplit {s['perplexity_unsplit']:.2f}), "
              f"{metric} {p[metric]:.2f}; the cheapest of {len(options)} configurations that meet "
              f"the bound" + ("; 2-way cuts send the labels in training, so only U-shapes qualify"
                             if sweep["mode"] == "train" else ""))
    gradient = None  # U-shape training: was the gradient at the second cut measured?
    if sweep["mode"] == "train" and len(cuts) == 2:
        gradient = s.get("token_recovery_gradient") is not None
        if not gradient:
            reason += ("; the gradient the client sends at the second cut was NOT measured for this row "
                       "(python -m splitlearn.privacy --gradient-attacks): the leakage counts the "
                       "activations only")
    return {"cuts": cuts, "defense": d, metric: p[metric], "leakage": s["leakage"],
            "perplexity": s["perplexity"], "defense_trained": bool(s.get("defense_trained")),
            "finetune_steps": s.get("finetune_steps") or 0, "gradient_measured": gradient,
            "reason": reason}
