"""What a request costs in memory: the server's cost model (splitlearn/server/engine/budget.py)
against the peak it measures.

    python benchmarks/request_memory.py            # GPT-2 vocab + small width, and GPT-2 small's shape
    python benchmarks/request_memory.py --quick    # the small models only (a minute)

Each case runs in a fresh process: build the server's app around a ``SegmentRuntime``, send
one small request of the route (kernels loaded, AdamW state made), give freed memory back to
the system (``malloc_trim``), then reset the peak RSS (``/proc/self/clear_refs``: 5), send
the request through Flask's test client and read the peak (``VmHWM``). The measured figure
is that peak less the RSS just before: everything the route allocated, the allocator's own
slack included. The model's prediction must never be below it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: model config (JSON), 2-way cut, U-shape cuts
MODELS = {
    "gpt2-vocab-d64": (dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=64, n_layer=2,
                            n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), (1,), (1, 2)),
    "gpt2-small": ("random:gpt2", (2,), (2, 10)),
}
# (model, route, rows, positions, padded)
CASES = [
    ("gpt2-vocab-d64", "train_step", 1, 128, False),
    ("gpt2-vocab-d64", "train_step", 8, 1024, False),
    ("gpt2-vocab-d64", "train_step", 16, 512, True),
    ("gpt2-vocab-d64", "forward", 64, 1024, False),
    ("gpt2-vocab-d64", "forward+labels", 16, 1024, True),
    ("gpt2-vocab-d64", "train_forward", 16, 1024, True),
    ("gpt2-vocab-d64", "prefill", 16, 1024, False),
    ("gpt2-small", "train_step", 1, 128, False),
    ("gpt2-small", "train_step", 4, 256, True),
    ("gpt2-small", "train_step", 2, 1024, False),
    ("gpt2-small", "train_forward", 4, 256, False),
    ("gpt2-small", "train_forward", 1, 1024, True),
    ("gpt2-small", "forward+labels", 8, 512, True),
    ("gpt2-small", "prefill", 8, 512, False),
]


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(field)


def child(model: str, route: str, B: int, T: int, pad: bool) -> dict:
    """Measure one case in this process (a fresh one)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from serverproc import TOKEN, auth, post_tensors

    from splitlearn.api import protocol as P
    from splitlearn.server.engine import budget as bm
    from splitlearn.server.http.app import create_app
    from splitlearn.server.config import ServerConfig

    torch.set_num_threads(2)
    spec, cut2, cutu = MODELS[model]
    if isinstance(spec, dict):
        path = Path(tempfile.mkdtemp()) / f"{model}.json"
        path.write_text(json.dumps(spec))
        spec = str(path)
    u = route == "train_forward"
    app = create_app(ServerConfig(model=spec, cuts=cutu if u else cut2, tokens=(TOKEN,),
                                  max_request_memory_bytes=1 << 50))
    rt = app.extensions["splitlearn"]
    client = app.test_client()
    d, V = rt.config.n_embd, rt.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def body(b, t, step):
        h = torch.randn(b, t, d, generator=g)
        tensors = {P.HIDDEN: h, P.LABELS: torch.randint(0, V, (b, t), generator=g)}
        if pad:
            mask = torch.ones(b, t, dtype=torch.long)
            mask[0, : t // 4] = 0
            tensors[P.MASK] = mask
        if route == "forward":
            tensors.pop(P.LABELS)
        return tensors, P.StepMeta("c", step).to_meta()

    def run(b, t, step):
        tensors, meta = body(b, t, step)
        if route in ("train_step", "train_forward"):
            path = P.TRAIN_STEP if route == "train_step" else P.TRAIN_FORWARD
            tensors.pop(P.LABELS) if u else None
            r = post_tensors(client, path, tensors, meta)
            assert r.status_code == 200, r.get_data(as_text=True)
            if u:
                grad = {P.GRAD: torch.randn(b, t, d, generator=g)}
                r = post_tensors(client, P.TRAIN_BACKWARD, grad, meta)
                assert r.status_code == 200, r.get_data(as_text=True)
            r = client.post(P.TRAIN_APPLY, json={"client_id": "c", "step": step, "pieces": 1, "lr": 1e-4},
                            headers=auth())
            assert r.status_code == 200, r.get_data(as_text=True)
        elif route.startswith("forward"):
            r = post_tensors(client, P.FORWARD, tensors, {})
            assert r.status_code == 200, r.get_data(as_text=True)
        else:  # prefill: a session of b rows, t positions at once
            sid = client.post(P.SESSIONS, json={"rows": b}, headers=auth()).get_json()["session_id"]
            meta = P.SessionStepMeta(0).to_meta()
            r = post_tensors(client, P.SESSION_STEP.format(session_id=sid), {P.HIDDEN: tensors[P.HIDDEN]}, meta)
            assert r.status_code == 200, r.get_data(as_text=True)

    run(1, 8, 1)  # warm: kernels, AdamW state
    m = bm.Dims.of(rt.segment, rt.dtype, rt.device)
    if route in ("train_step", "train_forward"):
        predicted = bm.train_cost(m, B, T, pad)
    elif route.startswith("forward"):
        predicted = bm.forward_cost(m, B, T, pad, labels=route == "forward+labels")
    else:
        predicted = bm.session_step_cost(m, B, 0, T, pad)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    run(B, T, 2)
    measured = _status("VmHWM") - before
    return {"model": model, "route": route, "B": B, "T": T, "padded": pad, "predicted": predicted,
            "measured": measured, "ratio": predicted / max(1, measured)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the small models only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(*json.loads(a.child))))
        return 0
    print("| model | route | B x T | padded | predicted MiB | measured peak MiB | predicted / measured |")
    print("|---|---|---|---|---|---|---|")
    worst = None
    for case in CASES:
        if a.quick and case[0] == "gpt2-small":
            continue
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], cwd=ROOT,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        worst = r["ratio"] if worst is None else min(worst, r["ratio"])
        print(f"| {r['model']} | {r['route']} | {r['B']} x {r['T']} | {'yes' if r['padded'] else 'no'} "
              f"| {r['predicted'] / 2**20:.0f} | {r['measured'] / 2**20:.0f} | {r['ratio']:.2f} |", flush=True)
    print(f"lowest predicted / measured: {worst:.2f} (must stay >= 1)")
    return 0 if worst is not None and worst >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
