"""Baselines for the benchmarks: the same U-shape split done the ways users would otherwise do it.

    naive_json.NaiveJsonSplit   Flask dev server + ``requests``, tensors as JSON lists, no KV cache
    torch_rpc.TorchRpcSplit     ``torch.distributed.rpc`` (TensorPipe), distributed autograd

Both hold bottom + top in this process and run the trunk in a child process on loopback, with
the same model, cuts, optimizer (AdamW, no weight decay) and data as ``splitlearn``, so any
difference a benchmark shows comes from the transport and the protocol, not from the math.
What they share (config, command line, partitioning, the server child process) is in ``common``.

The classes are imported lazily (PEP 562), so ``import benchmarks.baselines`` pulls in neither
Flask nor ``torch.distributed.rpc``.
"""
from __future__ import annotations

import importlib

__all__ = ["NaiveJsonSplit", "TorchRpcSplit"]

_WHERE = {"NaiveJsonSplit": ".naive_json", "TorchRpcSplit": ".torch_rpc"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
