"""LoRA for ``SplitClient``: ``SplitClient(url, model, lora=peft.LoraConfig(r=8, lora_alpha=16,
target_modules=["c_attn"], fan_in_fan_out=True))`` puts peft's LoRA layers on the client's blocks
through the model classes (:func:`splitlearn.hf.lora.apply_lora`: the same adapters, initialised
by :func:`splitlearn.lora.init_adapter_pair`, shared alone under the federation modes), and its
optimizer trains them alone; ``export_adapter`` writes both sides' adapters as one peft adapter
(:func:`splitlearn.hf.lora.export_adapter`). Here: the client's adapters read off its segments.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..lora import ADAPTER, PREFIX, hf_module_name
from ..segments import Segment


def client_adapter_tensors(segments: Sequence[Segment]) -> dict[str, torch.Tensor]:
    """The client's adapters under peft's saved names (what a sync and an export carry)."""
    out = {}
    for seg in segments:
        for name, m in seg.named_modules():
            if hasattr(m, "lora_A") and ADAPTER in getattr(m, "lora_A", {}):
                name = PREFIX + hf_module_name(seg, name)
                out[f"{name}.lora_A.weight"] = m.lora_A[ADAPTER].weight.detach().cpu().contiguous()
                out[f"{name}.lora_B.weight"] = m.lora_B[ADAPTER].weight.detach().cpu().contiguous()
    return out
