"""The LoRA configuration (:class:`LoraSpec`, the target modules), plain data without torch: the
server's config and its ``--help`` read it (issue 54: ``python -m splitlearn.server --help``
imports no torch). The adapters themselves are in :mod:`.lora`, which re-exports both names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

CONV1D_TARGETS = ("c_attn", "c_proj", "c_fc")  # GPT-2's Conv1D layers (c_proj: attention and MLP)
#: the linear layers (``nn.Linear``) of the other families (docs/MODELS.md): the Llama-like ones'
#: (Llama, Qwen2/3, Mistral, Gemma 1-3: attention q/k/v/o, the gated MLP's gate/up/down), Phi-3's
#: fused ``qkv_proj``/``gate_up_proj``, GPT-NeoX's and Falcon's ``query_key_value``, ``dense``,
#: ``dense_h_to_4h``, ``dense_4h_to_h``, OPT's ``out_proj``, ``fc1``, ``fc2``
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "qkv_proj", "gate_up_proj", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
                  "out_proj", "fc1", "fc2")
TARGETS = CONV1D_TARGETS + LINEAR_TARGETS


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA configuration, the same for the server's and the client's segments."""

    r: int = 8  # rank of every adapter
    alpha: float = 16.0  # the update is scaled by alpha / r
    targets: tuple[str, ...] = ("c_attn",)  # module names (last component) that get adapters
    dropout: float = 0.0  # dropout probability on the adapter's input while training

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError(f"LoRA rank r must be an integer > 0, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ConfigError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError(f"give at least one LoRA target module, among {', '.join(TARGETS)}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ConfigError(f"unknown LoRA target module(s) {', '.join(map(repr, unknown))}: the adaptable "
                              f"modules are GPT-2's {', '.join(CONV1D_TARGETS)} and the other families' linear layers "
                              f"{', '.join(LINEAR_TARGETS)}")
        if set(self.targets) & set(CONV1D_TARGETS) and set(self.targets) & set(LINEAR_TARGETS):
            raise ConfigError(f"LoRA targets {list(self.targets)} mix GPT-2's Conv1D names with linear ones: "
                              f"one family's names")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"duplicated LoRA target in {list(self.targets)}")
        object.__setattr__(self, "targets", tuple(sorted(self.targets)))  # order means nothing

    @property
    def conv1d(self) -> bool:
        """The targets are GPT-2's ``Conv1D`` layers ((in, out) weights: peft's ``fan_in_fan_out``)."""
        return set(self.targets) <= set(CONV1D_TARGETS)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSpec":
        return cls(int(d["r"]), float(d["alpha"]), tuple(d["targets"]), float(d.get("dropout", 0.0)))

    @classmethod
    def from_peft(cls, cfg) -> "LoraSpec":
        """From a ``peft.LoraConfig`` (its targets a list of :data:`TARGETS`' names)."""
        targets = cfg.target_modules
        if targets is None or isinstance(targets, str):
            raise ConfigError("give LoraConfig(target_modules=[...]) as a list of "
                              f"{', '.join(TARGETS)}, got {targets!r}")
        if getattr(cfg, "use_rslora", False) or getattr(cfg, "use_dora", False):
            raise ConfigError("rsLoRA and DoRA are not supported: plain LoRA only")
        # fan_in_fan_out: GPT-2's Conv1D layers need True, which peft also forces for them (and
        # False for nn.Linear): the exported config says what to_peft says
        return cls(int(cfg.r), float(cfg.lora_alpha), tuple(sorted(targets)), float(cfg.lora_dropout))

    def to_peft(self, base_model: Optional[str] = None):
        """The ``peft.LoraConfig`` of this spec (what an exported adapter is loaded with)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.targets),
                          lora_dropout=self.dropout, fan_in_fan_out=self.conv1d, bias="none",
                          task_type="CAUSAL_LM", base_model_name_or_path=base_model)
