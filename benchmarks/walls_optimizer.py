"""Alice's training beside mallory's attacks on the shared optimizer's statistics (issue 50, items 1, 3).

    python benchmarks/walls_optimizer.py                 # tiny-demo, U (2, 4), 150 steps of alice's
    python benchmarks/walls_optimizer.py --steps 60 --model tiny --cuts 1 3

One in-process server of two tenants (alice, mallory), AdamW at ``--lr``, the default clip.
Alice's steps are driven on the engine (the routes' own methods, on the compute thread); each
step fits the trunk's output to a fixed target (0.5 x mean squared distance, four batches in
turn). Mallory's go through the app with her own token, as an attacker's would. Printed per
scenario: alice's final loss (the mean over her last four steps, one per batch), its ratio to
her undisturbed run's, and the clip's bound before and after mallory's steps.

- ``deflate/*``: mallory applies between each two of alice's steps (``every`` 1) or once in five
  steps, ``"clip": 1e-12`` at lr 0 (the issue's attack: now nothing at all), at the full lr (AdamW
  steps of a gradient ~0), and the same with the clip off (the part the clip plays);
- ``deflate/idle``: 100 such steps at the full lr while alice is idle, then alice's 150;
- ``inflate/*``: 300 steps of mallory's gradient x 1e6 while alice is idle (after alice's
  ``--warm`` steps), at lr 0, at 1e-4 of the lr, at the full lr; then alice's 150.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(ROOT))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.api.wire import decode, encode  # noqa: E402
from splitlearn.server.config import ServerConfig  # noqa: E402
from splitlearn.server.http.app import create_app  # noqa: E402

ALICE_TOKEN, MALLORY_TOKEN = "bench-alice-5c1f0e8b2a9d", "bench-mallory-93be41d06f"
TENANTS = (f"alice {ALICE_TOKEN} operator", f"mallory {MALLORY_TOKEN}")
ALICE = "alice:a"


class Run:
    """One server; alice's and mallory's steps on it."""

    def __init__(self, args, factor="default"):
        kw = {} if factor == "default" else {"grad_clip_factor": factor}
        self.app = create_app(ServerConfig(model=args.model, cuts=tuple(args.cuts), tokens=TENANTS, lr=args.lr,
                                           torch_threads=1, **kw))
        self.rt = self.app.extensions["splitlearn"]
        self.rt.lease.grace_s = 0.0  # the two alternate at once (the lease's fairness is not measured here)
        self.client = self.app.test_client()
        self.lr, self.a, self.m = args.lr, 0, 0
        d = self.rt.config.n_embd
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randn(4, 16, d, generator=g), torch.randn(4, 16, d, generator=g)) for _ in range(4)]

    def alice(self) -> float:
        self.a += 1
        h, target = self.data[self.a % len(self.data)]
        meta, rt = P.StepMeta(ALICE, self.a), self.rt

        def step():
            out = rt.training.forward(meta, h, None).tensors[P.HIDDEN]
            rt.training.backward(meta, (out - target) / out.numel())
            rt.training.apply(ALICE, P.ApplyRequest(ALICE, self.a, 1, self.lr))
            return 0.5 * float(((out - target) ** 2).mean())
        with rt.lock:
            return rt.compute.run(step)

    def _post(self, path, tensors, meta):
        r = self.client.post(path, data=encode(tensors, meta), headers={
            "Authorization": f"Bearer {MALLORY_TOKEN}", "Content-Type": P.CONTENT_TYPE})
        assert r.status_code == 200, r.get_data(as_text=True)
        return decode(r.get_data())[0]

    def mallory(self, scale: float = 1.0, clip: float = 1.0, lr: float = P.MAX_LR) -> dict:
        self.m += 1
        h, target = self.data[1]
        meta = P.StepMeta("m", self.m).to_meta()
        out = self._post(P.TRAIN_FORWARD, {P.HIDDEN: h}, meta)[P.HIDDEN]
        self._post(P.TRAIN_BACKWARD, {P.GRAD: (out - target) / out.numel() * scale}, meta)
        body = {"client_id": "m", "step": self.m, "pieces": 1, "lr": lr, **({"clip": clip} if clip != 1.0 else {})}
        r = self.client.post(P.TRAIN_APPLY, data=json.dumps(body), headers={
            "Authorization": f"Bearer {MALLORY_TOKEN}", "Content-Type": "application/json"})
        assert r.status_code == 200, r.get_data(as_text=True)
        return r.get_json()

    def bound(self):
        return self.rt.grad_clip.bound()


def final(losses):
    return sum(losses[-4:]) / 4


def scenario(args, name: str) -> dict:
    kind, what = name.split("/")
    run = Run(args, None if what.endswith("noclip") else "default")
    losses = [run.alice() for _ in range(args.warm)]
    before = run.bound()
    if kind == "deflate" and what != "idle":
        lr = 0.0 if what.startswith("lr0") else P.MAX_LR
        every = 5 if "1in5" in what else 1
        for i in range(args.steps):
            if i % every == 0:
                run.mallory(clip=1e-12, lr=lr)
            losses.append(run.alice())
    else:
        if kind == "deflate":  # idle
            for _ in range(100):
                run.mallory(clip=1e-12)
        elif kind == "inflate":
            lr = {"lr0": 0.0, "tinylr": 1e-4 * args.lr, "fulllr": P.MAX_LR}[what]
            for _ in range(args.inflate):
                run.mallory(scale=1e6, lr=lr)
        mid = run.bound()
        losses += [run.alice() for _ in range(args.steps)]
        return {"loss": final(losses), "bound_before": before, "bound_attacked": mid}
    return {"loss": final(losses), "bound_before": before, "bound_attacked": run.bound()}


SCENARIOS = ("alone/alone", "deflate/lr0", "deflate/fulllr", "deflate/fulllr-noclip", "deflate/1in5",
             "deflate/idle", "inflate/lr0", "inflate/tinylr", "inflate/fulllr")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-demo")
    ap.add_argument("--cuts", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warm", type=int, default=20, help="alice's steps before mallory starts")
    ap.add_argument("--steps", type=int, default=150, help="alice's steps measured")
    ap.add_argument("--inflate", type=int, default=300, help="mallory's x1e6 steps while alice is idle")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = None
    print(f"{args.model} U {tuple(args.cuts)}, lr {args.lr:g}, alice {args.warm} + {args.steps} steps")
    print(f"{'scenario':24s} {'alice loss':>11s} {'x alone':>8s} {'bound before':>13s} {'attacked':>10s}  s")
    for name in SCENARIOS:
        t0 = time.perf_counter()
        r = scenario(args, name)
        base = r["loss"] if base is None else base
        fmt = lambda b: "none" if b is None else f"{b:.4g}"  # noqa: E731
        print(f"{name:24s} {r['loss']:11.4g} {r['loss'] / base:8.3f} {fmt(r['bound_before']):>13s} "
              f"{fmt(r['bound_attacked']):>10s}  {time.perf_counter() - t0:.0f}", flush=True)


if __name__ == "__main__":
    main()
