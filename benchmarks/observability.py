"""What ``/metrics`` and JSON access lines cost a decode step (target: < 2%).

    python benchmarks/observability.py            # GPT-2 small shape, U-shape (2, 10), and tiny-demo
    python benchmarks/observability.py --quick    # tiny-demo only, fewer steps

Two servers of the same model run side by side, in one run:

- **on**: ``--log-format json --log-level INFO --access-log -`` (one JSON access line per request, written
  to a file: the server's stderr), every request counted in the Prometheus registry, and a
  scraper reading ``GET /metrics`` (operator token) every ``--scrape-s`` seconds (Prometheus'
  default is 15 s: 1 s is the pessimistic case);
- **off**: ``--no-request-log --log-level WARNING`` (no hook, no line; the scrape-time
  collector still exists but nobody scrapes).

One client sends batch-1 U-shape decode steps (1 x 1 x d float32 in and out, keep-alive
``requests.Session``), alternating between the two servers (the order flipped every round),
so drift on the shared machine falls on both alike. Reported per model: the median round
trip of each, the ratio on/off, and the median of the paired differences (ms and % of the
off median); in process, also the time spent in the two hooks themselves (a JSON line to a
file included), per request, the figure that noise on a shared machine does not blur.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests  # noqa: E402
import torch  # noqa: E402

from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from splitlearn.api.wire import decode, encode, pack  # noqa: E402


class Stepper:
    """Decode steps of one session on one server (a new session when the positions run out)."""

    def __init__(self, srv: LocalServer):
        self.url, self.http = srv.url, requests.Session()
        self.http.headers["Authorization"] = f"Bearer {srv.token}"
        info = self.http.get(self.url + P.INFO, timeout=30).json()
        self.d, self.npos = info["model_config"]["n_embd"], info["limits"]["max_position_embeddings"]
        self.sid, self.pos = None, 0
        self.g = torch.Generator().manual_seed(0)

    def _open(self) -> None:
        if self.sid is not None:
            self.http.delete(self.url + P.SESSION.format(session_id=self.sid), timeout=30)
        r = self.http.post(self.url + P.SESSIONS, json={"rows": 1}, timeout=30)
        r.raise_for_status()
        self.sid, self.pos = r.json()["session_id"], 0

    def step(self) -> float:
        """One decode step's round trip, seconds."""
        if self.sid is None or self.pos >= self.npos - 1:
            self._open()
        h = torch.randn(1, 1, self.d, generator=self.g)
        body = encode({**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(1, 1, dtype=torch.long)},
                      P.SessionStepMeta(self.pos, "float32").to_meta())
        t0 = time.perf_counter()
        r = self.http.post(self.url + P.SESSION_STEP.format(session_id=self.sid), data=body,
                           headers={"Content-Type": P.CONTENT_TYPE}, timeout=60)
        r.raise_for_status()
        decode(r.content)
        dt = time.perf_counter() - t0
        self.pos += 1
        return dt


def measure(model: str, cuts: tuple[int, int], steps: int, warmup: int, scrape_s: float, log_dir: Optional[Path]) -> dict:
    base = ["--model", model, "--cut", str(cuts[0]), "--cut", str(cuts[1]), "--threads", "4"]
    on = LocalServer(base + ["--log-format", "json", "--log-level", "INFO", "--access-log", "-"], quiet=False)
    on.capture_stderr = True  # the access lines go to a file, as a log shipper would read them
    off = LocalServer(base + ["--no-request-log"], quiet=True)
    with on, off:
        a, b = Stepper(on), Stepper(off)
        stop = threading.Event()
        scrapes = []

        def scrape():
            s = requests.Session()
            while not stop.wait(scrape_s):
                r = s.get(on.url + P.METRICS, headers={"Authorization": f"Bearer {on.token}"}, timeout=30)
                r.raise_for_status()
                scrapes.append(len(r.content))

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        for _ in range(warmup):
            a.step(), b.step()
        t_on, t_off = [], []
        for i in range(steps):
            if i % 2:
                t_on.append(a.step()), t_off.append(b.step())
            else:
                t_off.append(b.step()), t_on.append(a.step())
        stop.set()
        scraper.join()
        lines = [x for x in on.stderr_tail(1 << 30).splitlines() if x.startswith("{") and '"route"' in x]
        if log_dir is not None:  # a sample of the lines, beside the results
            (log_dir / f"access-{model.replace(':', '_')}.jsonl").write_text("\n".join(lines[-20:]) + "\n")
    med_on, med_off = statistics.median(t_on), statistics.median(t_off)
    diff = statistics.median(x - y for x, y in zip(t_on, t_off))
    return {"model": model, "cuts": list(cuts), "steps": steps, "median_on_ms": round(med_on * 1e3, 4),
            "median_off_ms": round(med_off * 1e3, 4), "ratio_on_off": round(med_on / med_off, 4),
            "paired_diff_ms": round(diff * 1e3, 4), "paired_diff_pct": round(100 * diff / med_off, 2),
            "access_lines": len(lines), "scrapes": len(scrapes),
            "metrics_bytes": scrapes[-1] if scrapes else None}


def hook_cost(model: str, cuts: tuple[int, int], steps: int, log_path: Path) -> dict:
    """The same comparison in one process, through Flask's test client (no HTTP, no second
    process: less noise on a busy machine): the app with its hooks and a JSON access line
    per request to a file, against the app without (``request_log=False``), interleaved."""
    from splitlearn.server.http import accesslog
    from splitlearn.server.http.app import create_app
    from splitlearn.server.config import ServerConfig

    token = "observability-bench-token-0123456789"
    apps = {k: create_app(ServerConfig(model=model, cuts=cuts, tokens=(token,), request_log=k == "on")).test_client()
            for k in ("on", "off")}
    handler = logging.FileHandler(log_path)
    handler.setFormatter(accesslog.JsonFormatter())
    logger = logging.getLogger("splitlearn.server.http.accesslog")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    auth = {"Authorization": f"Bearer {token}"}
    times = {"on": [], "off": []}
    hooks = []  # seconds in the two hooks, per request of the "on" app
    after = []  # seconds in what runs once the answer is sent (accesslog.record: queues it)
    drained = []  # seconds per record in the drainer (accesslog._write: its metrics and its line)
    begin, finish, record, write = accesslog.begin, accesslog.finish, accesslog.record, accesslog._write

    def timed_begin(*args):
        t0 = time.perf_counter()
        begin(*args)
        hooks.append(time.perf_counter() - t0)

    def timed_finish(*args):
        t0 = time.perf_counter()
        out = finish(*args)
        hooks[-1] += time.perf_counter() - t0
        return out

    def timed_record(*args):
        t0 = time.perf_counter()
        record(*args)
        after.append(time.perf_counter() - t0)

    def timed_write(*args):
        t0 = time.perf_counter()
        write(*args)
        drained.append(time.perf_counter() - t0)

    accesslog.begin, accesslog.finish, accesslog.record, accesslog._write = (timed_begin, timed_finish,
                                                                            timed_record, timed_write)
    try:
        sids = {k: c.post(P.SESSIONS, json={"rows": 1}, headers=auth).get_json()["session_id"] for k, c in apps.items()}
        d = apps["on"].get(P.INFO, headers=auth).get_json()["model_config"]["n_embd"]
        npos = apps["on"].get(P.INFO, headers=auth).get_json()["limits"]["max_position_embeddings"]
        g = torch.Generator().manual_seed(0)
        for i in range(steps):
            pos = i % (npos - 1)
            order = ("on", "off") if i % 2 else ("off", "on")
            for k in order:
                if pos == 0 and i:
                    apps[k].delete(P.SESSION.format(session_id=sids[k]), headers=auth)
                    sids[k] = apps[k].post(P.SESSIONS, json={"rows": 1}, headers=auth).get_json()["session_id"]
                body = encode({**pack(P.HIDDEN, torch.randn(1, 1, d, generator=g), "float32"),
                               P.MASK: torch.ones(1, 1, dtype=torch.long)}, P.SessionStepMeta(pos, "float32").to_meta())
                t0 = time.perf_counter()
                r = apps[k].post(P.SESSION_STEP.format(session_id=sids[k]), data=body,
                                 headers={**auth, "Content-Type": P.CONTENT_TYPE})
                times[k].append(time.perf_counter() - t0)
                assert r.status_code == 200, r.get_data(as_text=True)
    finally:
        accesslog.drain()
        accesslog.begin, accesslog.finish, accesslog.record, accesslog._write = begin, finish, record, write
        logger.removeHandler(handler)
        handler.close()
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    diff = statistics.median(x - y for x, y in zip(times["on"], times["off"]))
    return {"model": model, "in_process": True, "steps": steps, "median_on_ms": round(on * 1e3, 4),
            "median_off_ms": round(off * 1e3, 4), "ratio_on_off": round(on / off, 4),
            "paired_diff_ms": round(diff * 1e3, 4), "paired_diff_pct": round(100 * diff / off, 2),
            "hooks_us": round(statistics.median(hooks) * 1e6, 2),
            "hooks_pct_of_step": round(100 * statistics.median(hooks) / off, 3),
            "after_send_us": round(statistics.median(after) * 1e6, 2),
            "after_send_pct_of_step": round(100 * statistics.median(after) / off, 3),
            "drained_us": round(statistics.median(drained) * 1e6, 2),
            "drained_pct_of_step": round(100 * statistics.median(drained) / off, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny-demo only, 200 steps")
    p.add_argument("--steps", type=int, default=600, help="decode steps per server (alternating)")
    p.add_argument("--scrape-s", type=float, default=1.0, help="seconds between scrapes of the 'on' server")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    cases = [("tiny-demo", (2, 4))] if a.quick else [("random:gpt2", (2, 10)), ("tiny-demo", (2, 4))]
    steps = 200 if a.quick else a.steps
    log_dir = Path(a.json).parent if a.json else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = [hook_cost(m, c, 4 * steps, Path(tmp) / "access.jsonl") for m, c in cases]
    results += [measure(m, c, steps, 20, a.scrape_s, log_dir) for m, c in cases]
    print(f"{'model':<26}{'off ms':>9}{'on ms':>9}{'on/off':>8}{'paired diff':>14}")
    for r in results:
        where = "in-process" if r.get("in_process") else "2 servers, HTTP"
        print(f"{r['model'] + ' (' + where + ')':<26}{r['median_off_ms']:>9.3f}{r['median_on_ms']:>9.3f}{r['ratio_on_off']:>8.3f}"
              f"{r['paired_diff_ms']:>9.3f} ms ({r['paired_diff_pct']:+.2f}%)   "
              + (f"[{r['access_lines']} access lines, {r['scrapes']} scrapes]" if "scrapes" in r else
                 f"[hooks: {r['hooks_us']:.1f} us a request ({r['hooks_pct_of_step']:.2f}% of a step) before "
                 f"the answer, {r['after_send_us']:.1f} us ({r['after_send_pct_of_step']:.2f}%) after it, "
                 f"{r['drained_us']:.1f} us ({r['drained_pct_of_step']:.2f}%) in the drainer]"))
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
