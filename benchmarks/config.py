"""``BenchConfig``: what one benchmark run measures, and on what.

Every workload of a run reads the same config, so the systems it compares use the same
model, cuts, data and thread count. ``quick()`` is the smoke-test variant (a tiny model, one
repeat) that ``tests/test_benchmarks.py`` runs; the defaults are the published CPU run.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from splitlearn.api.wire import WIRE_DTYPE_NAMES as WIRE_DTYPES

WORKLOADS = ("codec", "overhead", "generation", "pinned", "training", "int8_drift", "concurrency",
             "server_batching")
BASELINES = ("naive", "rpc")  # naive JSON over Werkzeug; torch.distributed.rpc


@dataclass
class BenchConfig:
    model: str = "random:gpt2"  # GPT-2 small, random weights: the same on every side, offline
    u_cuts: tuple[int, int] = (2, 10)  # U-shape: client bottom [0,2) + top [10,12), server trunk
    two_way_cut: int = 2  # 2-way: client bottom [0,2), server top [2,12) with the LM head
    device: str = "cpu"  # cpu | cuda (servers and clients alike)
    dtype: str = "float32"  # compute dtype of every model (GPU training uses bfloat16)
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # torch threads per process
    repeats: int = 3  # timed runs per measurement (the median is reported)
    warmup: int = 1  # untimed runs before them
    workloads: tuple[str, ...] = WORKLOADS
    wire_dtypes: tuple[str, ...] = WIRE_DTYPES
    # the baselines compared where a workload has one (each of generation, training and
    # overhead); the RPC one starts a child process per measurement (~14 s each on 2 cores)
    baselines: tuple[str, ...] = BASELINES
    # stop every server and baseline between workloads, so one workload's memory does not weigh
    # on the next; the quick smoke test keeps them (process start-up is most of its time)
    restart_between_workloads: bool = True
    # how the harness starts its client processes (concurrency's clients, the pinned client):
    # "spawn", a fresh interpreter each; "forkserver", forked from a preloaded one (multiprocessing's
    # fork server; the tests' quick run, whose fork server has torch imported); either way each
    # sets its own torch threads (1) and loads its own model
    mp_context: str = "spawn"
    # generation
    prompt_len: int = 32
    new_tokens: int = 64
    gen_batches: tuple[int, ...] = (1, 8)
    naive_new_tokens: int = 8  # the naive baseline resends the whole sequence each step:
    # it gets these many tokens (its per-token rate only falls as the sequence grows)
    # training
    train_batch: int = 4
    train_seq: int = 128
    train_repeats: int = 5  # interleaved rounds (one step of every system per round)
    lr: float = 1e-4
    # codec
    codec_shape: tuple[int, int, int] = (4, 128, 768)
    codec_repeats: int = 50
    # overhead
    overhead_calls: int = 200
    # int8 drift: loss difference int8 activations cause over many training steps
    drift_model: str = "tiny-demo"
    drift_cuts: tuple[int, int] = (2, 4)
    drift_steps: int = 100
    drift_batch: int = 8
    drift_seq: int = 64
    drift_lr: float = 1e-3
    # concurrency: simultaneous generation clients (separate processes) on one server
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    concurrency_new_tokens: int = 64
    concurrency_prompt_len: int = 16
    # pinned: two devices emulated, client and server on cores of their own, one thread each
    pinned_cores: tuple[int, int] = (0, 1)  # (client core, server core)
    pinned_repeats: int = 3  # paired rounds (each system once per round)
    # server batching: light clients replay precomputed activations (no client compute)
    server_batching_clients: tuple[int, ...] = (1, 2, 4, 8)
    server_batching_new_tokens: int = 32  # decode steps per client
    server_batching_prompt_len: int = 16
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
        odd = set(self.baselines) - set(BASELINES)
        if odd:
            raise ValueError(f"unknown baselines {sorted(odd)}; choose from {', '.join(BASELINES)}")
        bad = set(self.wire_dtypes) - set(WIRE_DTYPES)
        if bad:
            raise ValueError(f"unknown wire dtypes {sorted(bad)}; choose from {', '.join(WIRE_DTYPES)}")
        if self.repeats < 1 or self.warmup < 0 or self.threads < 1:
            raise ValueError("repeats and threads must be >= 1, warmup >= 0")
        if self.mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be spawn or forkserver, got {self.mp_context!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.two_way_cut < 1 or not 0 < self.u_cuts[0] < self.u_cuts[1]:
            raise ValueError("cuts must leave the client at least one block")
        if self.pinned_repeats < 1 or self.server_batching_new_tokens < 1 or not self.server_batching_clients:
            raise ValueError("pinned_repeats and server_batching_new_tokens must be >= 1, "
                             "server_batching_clients non-empty")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def quick(cls, **overrides) -> "BenchConfig":
        """Seconds, not minutes: the tiny model, small shapes, one repeat (smoke test)."""
        base = dict(model="tiny", u_cuts=(1, 3), two_way_cut=1, repeats=1, warmup=0,
                    prompt_len=8, new_tokens=8, gen_batches=(1, 2), naive_new_tokens=4,
                    train_batch=2, train_seq=16, train_repeats=1, codec_shape=(2, 16, 32), codec_repeats=3,
                    overhead_calls=5, drift_model="tiny", drift_cuts=(1, 3), drift_steps=4,
                    drift_batch=2, drift_seq=16, concurrency=(1, 2), concurrency_new_tokens=4,
                    concurrency_prompt_len=4, threads=1, pinned_repeats=1, server_batching_clients=(1, 2),
                    server_batching_new_tokens=4, server_batching_prompt_len=4,
                    restart_between_workloads=False)
        return replace(cls(**base), **overrides)
