"""The LoRA configuration (:class:`LoraSpec`, the target modules), plain data without torch: the
server's config and its ``--help`` read it (issue 54: ``python -m splitlearn.server --help``
imports no torch). The adapters themselves are in :mod:`.lora`, which re-exports it.

The targets are module names (the last component: ``q_proj``), checked against the model they
adapt when the adapters are made (:func:`splitlearn.model.lora.check_targets`: a name its layers
do not have is refused, naming the ones they have); none given: the family's attention default
(:func:`splitlearn.model.arch.lora_default_targets`, peft's own table), fixed by :meth:`LoraSpec.for_config`."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

from ..errors import ConfigError

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a module name's last component


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA configuration, the same for the server's and the client's segments."""

    r: int = 8  # rank of every adapter
    alpha: float = 16.0  # the update is scaled by alpha / r
    # module names (last component) that get adapters; None: the family's attention default (for_config)
    targets: Optional[tuple[str, ...]] = None
    dropout: float = 0.0  # dropout probability on the adapter's input while training

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        if self.targets is not None:
            object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError(f"LoRA rank r must be an integer > 0, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ConfigError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is None:
            return  # the family's default, fixed by for_config once the model is known
        if not self.targets:
            raise ConfigError("give at least one LoRA target module (a module name of the model's layers, "
                              "e.g. q_proj), or none for the family's attention default")
        bad = [t for t in self.targets if not isinstance(t, str) or not NAME.fullmatch(t)]
        if bad:
            raise ConfigError(f"LoRA target(s) {', '.join(map(repr, bad))} are not module names (the last "
                              f"component of a name, such as q_proj)")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"duplicated LoRA target in {list(self.targets)}")
        object.__setattr__(self, "targets", tuple(sorted(self.targets)))  # order means nothing

    def for_config(self, config) -> "LoraSpec":
        """This spec for a model of ``config`` (a transformers config): the family's attention
        default (peft's table: Llama's ``q_proj``, ``v_proj``) when no targets
        were given, else itself."""
        if self.targets is not None:
            return self
        from .arch import lora_default_targets  # torch: only once a model is there

        return replace(self, targets=lora_default_targets(config))

    @property
    def conv1d(self) -> bool:
        """The targets are ``Conv1D`` layers (GPT-2's; ``Family.conv1d`` in the adapter): (in, out)
        weights, peft's ``fan_in_fan_out``."""
        from .arch import conv1d_names  # torch: only where peft is used too

        return bool(self.targets) and set(self.targets) <= conv1d_names()

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict:
        targets = list(self.targets) if self.targets is not None else None
        return {"r": self.r, "alpha": self.alpha, "targets": targets, "dropout": self.dropout}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSpec":
        targets = tuple(d["targets"]) if d["targets"] is not None else None
        return cls(int(d["r"]), float(d["alpha"]), targets, float(d.get("dropout", 0.0)))

    @classmethod
    def from_peft(cls, cfg) -> "LoraSpec":
        """From a ``peft.LoraConfig`` (its targets a list of module names, or None: as peft, the
        family's default from peft's table)."""
        targets = cfg.target_modules
        if isinstance(targets, str):
            raise ConfigError(f"give LoraConfig(target_modules=[...]) as a list of module names, got {targets!r}")
        if getattr(cfg, "use_rslora", False) or getattr(cfg, "use_dora", False):
            raise ConfigError("rsLoRA and DoRA are not supported: plain LoRA only")
        # fan_in_fan_out: GPT-2's Conv1D layers need True, which peft also forces for them (and
        # False for nn.Linear): the exported config says what to_peft says
        targets = tuple(sorted(targets)) if targets is not None else None
        return cls(int(cfg.r), float(cfg.lora_alpha), targets, float(cfg.lora_dropout))

    def to_peft(self, base_model: Optional[str] = None):
        """The ``peft.LoraConfig`` of this spec (what an exported adapter is loaded with)."""
        from peft import LoraConfig

        if self.targets is None:
            raise ConfigError("this LoRA spec has no targets yet: LoraSpec.for_config(the model's config) first")
        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.targets),
                          lora_dropout=self.dropout, fan_in_fan_out=self.conv1d, bias="none",
                          task_type="CAUSAL_LM", base_model_name_or_path=base_model)
