"""Device and dtype names as users type them (``auto``, ``cuda``, ``bfloat16``) -> torch objects."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..errors import ConfigError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``"bfloat16"`` -> ``torch.bfloat16``; None stays None (keep what the model has)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """``auto``/None -> cuda when available else cpu; ``cuda`` without a GPU is an error."""
    if isinstance(device, torch.device):
        return device
    name = (device or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is available")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: {e}") from None


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on CPU); call before reading a wall clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
