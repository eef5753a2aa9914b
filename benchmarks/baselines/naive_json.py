"""The naive baseline: a U-shape split over Flask + ``requests`` with tensors as JSON lists.

This is how most split-learning repositories on GitHub do it, and so what a user would write
before reaching for splitlearn: a Flask app on the Werkzeug development server
(``app.run(threaded=True)``), activations sent as ``tensor.tolist()`` and rebuilt with
``torch.tensor(json)``, a client calling ``requests.post(url, json=...)`` with no Session
(a new TCP connection per request), and generation with no KV cache anywhere::

    training (one step)
      client: ids -> bottom -> h1 (B, T, d)
              POST /forward  {"hidden": h1.tolist()}  -->  server: h2 = trunk(h1), keeps the graph
              <-- {"hidden": h2.tolist()}  (B, T, d)
      client: h2 -> top -> loss; loss.backward() -> dL/dh2
              POST /backward {"grad": dL/dh2.tolist()} -->  server: backward, AdamW step
              <-- {"grad": dL/dh1.tolist()}  (B, T, d)
      client: h1.backward(dL/dh1); AdamW step

    generation, every new token (greedy)
      client: bottom(whole sequence) -> h1 (B, L, d)
              POST /infer {"hidden": h1.tolist()}  -->  server: trunk(whole sequence)
              <-- {"hidden": h2.tolist()}  (B, L, d)
      client: top(whole sequence)[:, -1].argmax() -> next token; L grows by one

    POST /ping {} -> {}   (the cost of one request, nothing computed)

A float32 survives the JSON round trip exactly (``tolist`` gives the double that holds it,
``json`` writes the shortest repr that round-trips, ``torch.tensor`` rounds back to the same
float32), so the math equals splitlearn's float32 wire; only the cost differs. The server
handles one client: it keeps one pending forward graph, under a lock.

Server: ``python benchmarks/baselines/naive_json.py --model tiny --cut 1 --cut 3 --port 8001``.
Client: ``with NaiveJsonSplit("tiny", (1, 3)) as split: split.train_step(ids)`` starts one.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import requests
import torch
from flask import Flask, jsonify, request

from splitlearn import load_model, partition
from splitlearn.checkpoint import make_optimizer, unique_parameters
from splitlearn.segments import Segment, loss_from_logits
from splitlearn.localserver import free_port

SCRIPT = Path(__file__).resolve()


@dataclass
class NaiveServerConfig:
    model: str  # model source, as for splitlearn.load_model ("tiny", "random:gpt2", a directory)
    cuts: tuple[int, int]  # U-shape cuts c1 < c2: the server holds blocks [c1, c2)
    port: int  # TCP port on 127.0.0.1
    lr: float = 1e-3  # AdamW learning rate of the trunk (no weight decay, as splitlearn's default)
    seed: int = 0  # seed of random inits; the client must use the same
    torch_threads: Optional[int] = None  # torch intra-op threads of the server; None: torch's default

    def __post_init__(self):
        self.cuts = tuple(int(c) for c in self.cuts)
        if len(self.cuts) != 2:
            raise ValueError(f"the naive baseline is a U-shape: give two cuts, got {list(self.cuts)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must lie in [1, 65535], got {self.port}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")

    def argv(self) -> list[str]:
        """The command-line arguments of :func:`main` that rebuild this config."""
        args = ["--model", self.model, "--cut", str(self.cuts[0]), "--cut", str(self.cuts[1]),
                "--port", str(self.port), "--lr", repr(self.lr), "--seed", str(self.seed)]
        return args + ([] if self.torch_threads is None else ["--torch-threads", str(self.torch_threads)])


def _to_json(t: torch.Tensor) -> list:
    return t.detach().float().cpu().tolist()


def _from_json(data: list, like: torch.nn.Module) -> torch.Tensor:
    return torch.tensor(data, dtype=next(like.parameters()).dtype)


# -- server ------------------------------------------------------------------------------

def load_trunk(cfg: NaiveServerConfig) -> Segment:
    """The trunk (blocks [c1, c2)) of the model; the rest of the model is dropped."""
    return partition(load_model(cfg.model, seed=cfg.seed), cfg.cuts).trunk


def create_app(cfg: NaiveServerConfig, trunk: Optional[Segment] = None) -> Flask:
    """The Flask app serving ``trunk`` (loaded from ``cfg`` when not given)."""
    trunk = trunk if trunk is not None else load_trunk(cfg)
    optimizer = make_optimizer(trunk.parameters(), "adamw", cfg.lr, 0.0)
    lock = threading.Lock()
    pending: dict[str, torch.Tensor] = {}  # the last /forward's input and output (graph kept)
    app = Flask(__name__)

    @app.post("/ping")
    def ping():
        return jsonify({})

    @app.post("/forward")
    def forward():
        h1 = _from_json(request.get_json()["hidden"], trunk).requires_grad_()  # (B, T, d)
        with lock:
            trunk.train()
            h2 = trunk(h1)  # (B, T, d)
            pending.update(h1=h1, h2=h2)
            return jsonify({"hidden": _to_json(h2)})

    @app.post("/backward")
    def backward():
        grad = _from_json(request.get_json()["grad"], trunk)  # (B, T, d) dL/dh2
        with lock:
            if "h2" not in pending:
                return jsonify({"error": "POST /forward before /backward"}), 409
            h1, h2 = pending.pop("h1"), pending.pop("h2")
            optimizer.zero_grad(set_to_none=True)
            h2.backward(grad)
            optimizer.step()
            return jsonify({"grad": _to_json(h1.grad)})  # (B, T, d) dL/dh1

    @app.post("/infer")
    def infer():
        h1 = _from_json(request.get_json()["hidden"], trunk)  # (B, L, d), the whole sequence
        with lock, torch.no_grad():
            trunk.eval()
            return jsonify({"hidden": _to_json(trunk(h1))})

    return app


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description="naive JSON split-learning server (the trunk of a U-shape)")
    p.add_argument("--model", required=True, help="model source: tiny, random:gpt2, a directory, ...")
    p.add_argument("--cut", type=int, action="append", required=True, help="give twice: c1 and c2")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    a = p.parse_args(argv)
    cfg = NaiveServerConfig(a.model, tuple(a.cut), a.port, a.lr, a.seed, a.torch_threads)
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    create_app(cfg).run(host="127.0.0.1", port=cfg.port, threaded=True)


# -- client ------------------------------------------------------------------------------

class NaiveJsonSplit:
    """Bottom + top here, the trunk in a naive JSON server started as a child process.

    model_src, cuts, lr, seed: as for the server (both sides load the same model).
    torch_threads: the server's torch threads (this process keeps its own setting).
    startup_timeout_s: how long to wait for the server to answer its first /ping.
    ``stats``: ``calls``, ``bytes_sent``, ``bytes_received`` (HTTP request/response bodies).
    """

    def __init__(self, model_src: str, cuts: Sequence[int], *, lr: float = 1e-3, seed: int = 0,
                 torch_threads: Optional[int] = None, startup_timeout_s: float = 120.0):
        self.cfg = NaiveServerConfig(model_src, tuple(cuts), free_port(), lr, seed, torch_threads)
        self.url = f"http://127.0.0.1:{self.cfg.port}"
        self.startup_timeout_s = startup_timeout_s
        parts = partition(load_model(model_src, seed=seed), self.cfg.cuts)
        self.bottom, self.top = parts.bottom, parts.top  # the trunk dies with `parts`
        self.optimizer = make_optimizer(unique_parameters([self.bottom, self.top]), "adamw", lr, 0.0)
        self.stats = {"calls": 0, "bytes_sent": 0, "bytes_received": 0}
        self.proc: Optional[subprocess.Popen] = None
        self._stderr = None

    # -- the server process --------------------------------------------------------------

    def start(self) -> "NaiveJsonSplit":
        env = dict(os.environ)
        if self.cfg.torch_threads is not None:
            env.update(OMP_NUM_THREADS=str(self.cfg.torch_threads), MKL_NUM_THREADS=str(self.cfg.torch_threads))
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *self.cfg.argv()], env=env,
                                     stdout=subprocess.DEVNULL, stderr=self._stderr)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"naive JSON server exited with code {self.proc.returncode}:\n"
                                   f"{self._stderr_tail()}")
            try:
                requests.post(self.url + "/ping", json={}, timeout=1).raise_for_status()
                return self
            except requests.ConnectionError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"naive JSON server did not answer on {self.url} within {self.startup_timeout_s}s")

    def _stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> "NaiveJsonSplit":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------------

    def _post(self, path: str, payload: dict) -> dict:
        r = requests.post(self.url + path, json=payload, timeout=600)  # no Session, on purpose
        if r.status_code != 200:
            raise RuntimeError(f"POST {path} answered {r.status_code}: {r.text[:500]}")
        self.stats["calls"] += 1
        self.stats["bytes_sent"] += len(r.request.body or b"")
        self.stats["bytes_received"] += len(r.content)
        return r.json()

    def ping(self) -> None:
        """One request that computes nothing: the per-request overhead."""
        self._post("/ping", {})

    def train_step(self, input_ids: torch.Tensor) -> float:
        """One AdamW step on both sides for a batch (B, T) with labels = input_ids; the loss."""
        ids = torch.as_tensor(input_ids)
        self.bottom.train()
        self.top.train()
        self.optimizer.zero_grad(set_to_none=True)
        h1 = self.bottom(ids)  # (B, T, d)
        h2 = _from_json(self._post("/forward", {"hidden": _to_json(h1)})["hidden"], self.top)
        h2.requires_grad_()  # (B, T, d)
        loss = loss_from_logits(self.top(h2), ids)
        loss.backward()
        grad = _from_json(self._post("/backward", {"grad": _to_json(h2.grad)})["grad"], self.bottom)
        h1.backward(grad)  # (B, T, d) dL/dh1
        self.optimizer.step()
        return float(loss.detach())

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.LongTensor:
        """Greedy: prompt (B, T) + ``max_new_tokens`` tokens, (B, T + new); no padding, no cache."""
        ids = torch.as_tensor(input_ids)
        n_pos = self.bottom.config.n_positions
        if ids.shape[1] + max_new_tokens > n_pos:
            raise ValueError(f"prompt of {ids.shape[1]} tokens + {max_new_tokens} new passes n_positions={n_pos}")
        self.bottom.eval()
        self.top.eval()
        for _ in range(max_new_tokens):
            h1 = self.bottom(ids)  # (B, L, d): the whole sequence, every step
            h2 = _from_json(self._post("/infer", {"hidden": _to_json(h1)})["hidden"], self.top)
            tok = self.top(h2)[:, -1, :].argmax(-1)  # (B,)
            ids = torch.cat([ids, tok[:, None]], dim=1)  # (B, L + 1)
        return ids


if __name__ == "__main__":
    main()
