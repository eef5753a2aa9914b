"""Where a split decode step's time goes: each segment's compute, and the client's profile.

    python -m benchmarks.profile_decode                      # segment table, batches 1, 4, 8
    python -m benchmarks.profile_decode --cprofile --batch 1 # + cProfile of SplitClient.generate
                                                             #   against a pinned server

The segment table times, in this process pinned to one core with one torch thread, one
decode step (one new position after a ``--prompt-len`` prompt, KV caches filled) of the
whole model and of the bottom, trunk and top of ``--cuts``: the compute a split moves, with
no transport. ``--cprofile`` starts a server pinned to another core (one thread), generates
with :class:`~splitlearn.client.SplitClient` and prints the client's functions by own time:
the socket wait is the server's share, ``linear``/``addmm`` the client's compute, the rest the
client's glue. (For the server side: ``py-spy record -p PID --idle --threads -f raw``.)
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from splitlearn import load_model, partition  # noqa: E402


@torch.no_grad()
def step_ms(segments, batch: int, prompt_len: int, d: int, steps: int = 16) -> float:
    """Median ms of one decode step through ``segments`` chained, caches filled first."""
    first = segments[0]
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, first.config.vocab_size, (batch, prompt_len), generator=g) if first.has_embeddings
         else torch.randn(batch, prompt_len, d, generator=g))  # (B, P) ids or (B, P, d)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)  # (B, P)
    caches = [s.new_cache() for s in segments]
    for s, c in zip(segments, caches):
        x = s(x, mask, c, logits_to_keep=1)
    times = []
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)  # (B, past + 1)
        x = (torch.zeros(batch, 1, dtype=torch.long) if first.has_embeddings
             else torch.randn(batch, 1, d, generator=g))  # (B, 1) or (B, 1, d)
        t0 = time.perf_counter()
        for s, c in zip(segments, caches):
            x = s(x, mask, c, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def segment_table(model_src: str, cuts: tuple[int, int], batches: list[int], prompt_len: int) -> list[dict]:
    model = load_model(model_src, seed=0)
    parts = partition(model, cuts)
    d = model.config.n_embd
    rows = []
    for B in batches:
        rows.append({"batch": B, "whole": step_ms([parts.bottom, parts.trunk, parts.top], B, prompt_len, d),
                     "bottom": step_ms([parts.bottom], B, prompt_len, d),
                     "trunk": step_ms([parts.trunk], B, prompt_len, d),
                     "top": step_ms([parts.top], B, prompt_len, d)})
    return rows


def client_profile(model_src: str, cuts: tuple[int, int], batch: int, prompt_len: int, new_tokens: int,
                   cores: tuple[int, int]) -> str:
    import io

    from splitlearn.client import SplitClient
    from splitlearn.procs.localserver import LocalServer

    os.sched_setaffinity(0, {cores[1]})  # the server inherits this core
    args = ["--model", model_src, "--torch-threads", "1", "--device", "cpu"] + \
        [a for c in cuts for a in ("--cut", str(c))]
    with LocalServer(args, env={"OMP_NUM_THREADS": "1"}) as srv:
        os.sched_setaffinity(0, {cores[0]})
        model = load_model(model_src, seed=0)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
        with SplitClient(srv.url, model, token=srv.token, device="cpu") as client:
            client.generate(ids, max_new_tokens=4)  # warm-up
            prof = cProfile.Profile()
            prof.runcall(client.generate, ids, max_new_tokens=new_tokens)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_decode", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--cuts", type=int, nargs=2, default=[2, 10])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--core", type=int, default=0, help="core of this process (the client)")
    p.add_argument("--cprofile", action="store_true", help="also profile SplitClient.generate against a "
                                                            "server pinned to --server-core")
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--batch", type=int, default=1, help="batch of the --cprofile generation")
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args(argv)
    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    print(f"ms per decode step, one core, one thread ({a.model}, cuts {tuple(a.cuts)}, prompt {a.prompt_len}):")
    print(f"{'batch':>6} {'whole':>8} {'bottom':>8} {'trunk':>8} {'top':>8} {'b+t+t':>8}")
    for r in segment_table(a.model, tuple(a.cuts), a.batches, a.prompt_len):
        print(f"{r['batch']:>6} {r['whole']:8.2f} {r['bottom']:8.2f} {r['trunk']:8.2f} {r['top']:8.2f} "
              f"{r['bottom'] + r['trunk'] + r['top']:8.2f}")
    if a.cprofile:
        print(client_profile(a.model, tuple(a.cuts), a.batch, a.prompt_len, a.new_tokens,
                             (a.core, a.server_core)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
