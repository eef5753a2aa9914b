"""Where a split training step's time goes: both sides of one step, in one process.

    python benchmarks/profile_step.py --device cuda                      # GPT-2 small, U (2, 10), 8 x 1024
    python benchmarks/profile_step.py --device cpu --model tiny-768      # the fixed cost, tiny compute

The server is a process of its own (``python -m splitlearn.server``, TCP and ``unix://``), or with
``--in-process`` its app and doors run in threads of this process (one profiler sees both sides):

- timings: the median step over ``--steps`` for the unsplit model and the split over each transport;
- ``--torch-profile DIR``: ``torch.profiler`` (CPU and, on CUDA, CUDA activities) of a few split
  steps per transport: ``DIR/<transport>.txt`` (this process's key averages by self CPU time and
  by device time; in process: both sides), ``DIR/<transport>.json`` (a Chrome trace, with
  ``--trace``) and, with a server process, ``DIR/server-profile.txt`` (its ``--profile-dir``
  tables: every request it served, the warm-up and timed steps too);
- ``--cprofile DIR`` (with ``--in-process``): Python's profiler in every thread (the client's, the
  doors', the server's compute thread) over the whole run, merged: ``DIR/steps.cprofile.txt``
  (the timings above are then the profiled ones).

``--model tiny-768``: one block of d=768 (the per-step fixed cost with almost no compute, the CPU
bench of issue 42); any model spec of ``splitlearn.model.loading`` otherwise.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

TOKEN = "profile-token-8d1c55e0a7"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def in_process_server(argv: list[str], sock: str):
    """The app, a TCP front door and a ``unix://`` door, served from threads of this process."""
    from splitlearn.server.http.app import create_app
    from splitlearn.server.http.cli import parse_args
    from splitlearn.server.http.frontdoor import make_server
    from splitlearn.server.http.unixdoor import UnixDoor

    os.environ["SPLITLEARN_TOKEN"] = TOKEN
    from splitlearn.procs.localserver import free_port
    port = free_port()
    cfg = parse_args(argv + ["--port", str(port), "--listen", "unix://" + sock])
    app = create_app(cfg)
    server = make_server(app, cfg.tenants, host="127.0.0.1", port=port, threads=cfg.threads,
                         max_body_bytes=cfg.max_body_bytes, limits=cfg.door_limits())
    door = UnixDoor(app, cfg.tenants, sock, max_body_bytes=cfg.max_body_bytes, limits=cfg.door_limits()).start()
    threading.Thread(target=server.run, daemon=True).start()
    return {"tcp": f"http://127.0.0.1:{port}", "unix": "unix://" + sock}, (server, door)


class AllThreads:
    """cProfile in every thread started from now on, and in this one."""

    def __init__(self):
        self.profiles: list[cProfile.Profile] = []

    def _start(self, *_):
        sys.setprofile(None)
        p = cProfile.Profile()
        self.profiles.append(p)
        p.enable()

    def __enter__(self):
        threading.setprofile(self._start)
        self._start()
        return self

    def __exit__(self, *exc):
        threading.setprofile(None)

    def report(self, path: Path, top: int = 45) -> None:
        out = io.StringIO()
        st = None
        for p in self.profiles:
            try:
                st = pstats.Stats(p, stream=out) if st is None else (st.add(p) or st)
            except TypeError:  # a profile with nothing in it
                continue
        if st is not None:
            st.sort_stats("tottime").print_stats(top)
            st.sort_stats("cumulative").print_stats(top)
        path.write_text(out.getvalue())


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--model", default="random:gpt2")
    a.add_argument("--cuts", default="2,10")
    a.add_argument("--batch", type=int, default=8)
    a.add_argument("--seq", type=int, default=1024)
    a.add_argument("--wire", default="bfloat16")
    a.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    a.add_argument("--micro", type=int, default=1)
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--transports", default="unix,tcp")
    a.add_argument("--torch-profile", help="directory for torch.profiler tables")
    a.add_argument("--trace", action="store_true", help="with --torch-profile: also a Chrome trace")
    a.add_argument("--in-process", action="store_true", help="the server's app and doors in threads of this process")
    a.add_argument("--cprofile", help="with --in-process: directory for cProfile tables (every thread)")
    args = a.parse_args(argv)

    from splitlearn.model.checkpoint import make_optimizer
    from splitlearn.client import SplitClient
    from splitlearn.model.loading import load_model

    from benchmarks.generation import prompts
    from benchmarks.config import BenchConfig
    from benchmarks.training import unsplit_step

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    spec, cuts = args.model, tuple(int(c) for c in args.cuts.split(","))
    if spec == "tiny-768":  # GPT-2 small's width, one block a segment, a 256-token vocabulary: little compute
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        spec, cuts = tempfile.mkdtemp(prefix="sl-prof-model-"), (1, 2)
        GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=768, n_head=12, vocab_size=256, n_positions=1024,
                                   bos_token_id=0, eos_token_id=0)).save_pretrained(spec)
    server_argv = ["--model", spec, "--device", args.device, "--dtype", dtype, "--lr", "1e-4", "--threads", "16",
                   "--seed", "0"] + [x for c in cuts for x in ("--cut", str(c))]
    model = load_model(spec, device=args.device, dtype=getattr(torch, dtype))
    cfg = BenchConfig(device=args.device, dtype=dtype)
    ids = prompts(cfg, args.batch, model.config.vocab_size, args.seq).to(args.device)
    whole = AllThreads().__enter__() if args.cprofile and args.in_process else None  # every thread, the server's too
    sock = os.path.join(tempfile.mkdtemp(prefix="sl-prof-"), "s.sock")
    server = None
    if args.in_process:
        urls, _keep = in_process_server(server_argv, sock)
    else:
        from splitlearn.procs.localserver import LocalServer

        extra_args = ["--listen", "unix://" + sock]
        if args.torch_profile:
            extra_args += ["--profile-dir", str(Path(args.torch_profile).resolve())]
        server = LocalServer(server_argv + extra_args, token=TOKEN, quiet=False).start()
        urls = {"tcp": server.url, "unix": "unix://" + sock}
    opt = make_optimizer(model.parameters(), "adamw", 1e-4, 0.0)
    systems = {"unsplit": lambda: unsplit_step(model, opt, ids)}
    clients = {}
    for kind in args.transports.split(","):
        clients[kind] = SplitClient(urls[kind], model, token=TOKEN, device=args.device, wire_dtype=args.wire,
                                    seed=0, lr=1e-4, micro_batches=args.micro)
        systems[kind] = (lambda c=clients[kind]: c.train_step(ids))
    times = {k: [] for k in systems}
    for r in range(2 + args.steps):  # two warm-up rounds, interleaved
        for k, fn in systems.items():
            sync(args.device)
            t0 = time.perf_counter()
            fn()
            sync(args.device)
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
    wire = {}
    for kind, c in clients.items():  # what the transport did over the whole run, per step
        st, n = c.transport.stats, 2 + args.steps
        wire[kind] = (1e3 * st.server_compute_s / n, 1e3 * st.overhead_s / n, st.host_copy_bytes / n / 2**20,
                      (st.bytes_sent + st.bytes_received) / n / 2**20)
    base = statistics.median(times["unsplit"])
    print(f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; {args.model} cuts {cuts} "
          f"{args.batch}x{args.seq} compute {dtype} wire {args.wire} micro {args.micro}")
    for k, ts in times.items():
        m = statistics.median(ts)
        line = f"  {k:8s} {1e3 * m:9.2f} ms  {m / base:6.2f}x  (min {1e3 * min(ts):.2f})"
        if k in wire:
            line += (" | per step: server compute {:.1f} ms, round trips less that {:.1f} ms, host copies "
                     "{:.1f} MiB, on the wire {:.1f} MiB".format(*wire[k]))
        print(line)

    for kind in clients:
        fn = systems[kind]
        if args.torch_profile:
            out = Path(args.torch_profile)
            out.mkdir(parents=True, exist_ok=True)
            acts = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(3):
                    fn()
                sync(args.device)
            text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            if args.device == "cuda":
                text += "\n\n" + prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
            (out / f"{kind}.txt").write_text(text)
            if args.trace:
                prof.export_chrome_trace(str(out / f"{kind}.json"))
    if whole is not None:  # warm-up, timed steps and all transports together
        whole.__exit__()
        Path(args.cprofile).mkdir(parents=True, exist_ok=True)
        whole.report(Path(args.cprofile) / "steps.cprofile.txt")
    for c in clients.values():
        c.close()
    if server is not None:
        server.stop()  # SIGTERM: its --profile-dir tables are written
    return 0


if __name__ == "__main__":
    sys.exit(main())
