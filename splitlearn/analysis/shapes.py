"""Named model shapes the analyzer counts on the meta device, without weights
(``analyze_model_performance --model llama2-7b-shape --device meta``).

A shape is a config only: its parameters, MACs/FLOPs, KV and wire bytes follow from it, so a 7B
model's per-segment table takes seconds and no weight memory (docs/ANALYSIS.md, "A 7B model on
the meta device"). Shapes are refused on a real device: their random weights would be gigabytes
that tell nothing the meta device does not (a config JSON file gives random weights where wanted).
"""
from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig

from ..errors import ConfigError

#: name -> config fields (``model_type`` and the sizes; the rest are the family's defaults)
SHAPES = {
    # LLaMA-2-7B (Touvron et al. 2023, Table 1 and its config.json): 32 layers, d = 4096, 32 heads
    # (no GQA at 7B), SwiGLU MLP of 11008, vocabulary 32000, 4096 positions, untied head
    "llama2-7b-shape": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                            max_position_embeddings=4096, tie_word_embeddings=False),
}


def shape_config(name) -> Optional[PretrainedConfig]:
    """The config of the named shape, or None when ``name`` is not one."""
    if not isinstance(name, str) or name not in SHAPES:
        return None
    from ..model.loading import config_from_dict

    return config_from_dict(dict(SHAPES[name]))


def check_shape_device(name, device_type: str) -> None:
    """Refuse a named shape anywhere but on the meta device (see the module docstring)."""
    if isinstance(name, str) and name in SHAPES and device_type != "meta":
        raise ConfigError(f"{name!r} is a shape without weights: analyse it with --device meta "
                          f"(parameters, MACs/FLOPs and bytes; nothing is timed)")
