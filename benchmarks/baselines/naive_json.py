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
    GET /health -> {}     (readiness, for starting the server; not counted in the stats)

A float32 survives the JSON round trip exactly (``tolist`` gives the double that holds it,
``json`` writes the shortest repr that round-trips, ``torch.tensor`` rounds back to the same
float32), so the math equals splitlearn's float32 wire; only the cost differs. The server
handles one client: it keeps one pending forward graph, under a lock.

Server (from the repository root):
``python -m benchmarks.baselines.naive_json --model tiny --cut 1 --cut 3 --port 8001``.
Client: ``with NaiveJsonSplit("tiny", (1, 3)) as split: split.train_step(ids)`` starts one.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
from flask import Flask, jsonify, request

from splitlearn.model.checkpoint import make_optimizer, unique_parameters
from splitlearn.model.segments import Segment, loss_from_logits

from .common import (BaselineConfig, BaselineServer, BaselineSplit, check_generation_length, parse_config,
                     server_trunk)

MODULE = "benchmarks.baselines.naive_json"  # the server runs as `python -m MODULE`


def _to_json(t: torch.Tensor) -> list:
    return t.detach().float().cpu().tolist()


def _from_json(data: list, like: torch.nn.Module) -> torch.Tensor:
    return torch.tensor(data, dtype=next(like.parameters()).dtype)


# -- server ------------------------------------------------------------------------------

def create_app(cfg: BaselineConfig, trunk: Optional[Segment] = None) -> Flask:
    """The Flask app serving ``trunk`` (loaded from ``cfg`` when not given)."""
    trunk = trunk if trunk is not None else server_trunk(cfg)
    optimizer = make_optimizer(trunk.parameters(), "adamw", cfg.lr, 0.0)
    lock = threading.Lock()
    pending: dict[str, torch.Tensor] = {}  # the last /forward's input and output (graph kept)
    app = Flask(__name__)

    @app.get("/health")
    def health():
        return jsonify({})

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
    cfg = parse_config("naive JSON split-learning server (the trunk of a U-shape)", argv)
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    create_app(cfg).run(host="127.0.0.1", port=cfg.port, threaded=True)


# -- client ------------------------------------------------------------------------------

class NaiveJsonSplit(BaselineSplit):
    """Bottom + top here, the trunk in a naive JSON server started as a child process.

    Arguments as for :class:`~benchmarks.baselines.common.BaselineSplit`. ``stats``: ``calls``,
    ``bytes_sent``, ``bytes_received`` (HTTP request/response bodies).
    """

    def __init__(self, model_src: str, cuts: Sequence[int], **kw):
        super().__init__(model_src, cuts, **kw)
        self.optimizer = make_optimizer(unique_parameters([self.bottom, self.top]), "adamw", self.cfg.lr, 0.0)
        self.server = BaselineServer(MODULE, self.cfg, startup_timeout_s=self.startup_timeout_s)
        self.url = self.server.url

    def start(self) -> "NaiveJsonSplit":
        self.server.start()
        return self

    def close(self) -> None:
        self.server.stop(10)

    # -- calls ---------------------------------------------------------------------------

    def _post(self, path: str, payload: dict) -> dict:
        import requests  # the client's only: the server's process does without it (~1-4 s of imports)

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
        check_generation_length(self.bottom, ids, max_new_tokens)
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
