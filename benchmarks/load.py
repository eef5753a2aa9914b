"""Load: N data owners generating and training at once, against one server and two replicas.

    python benchmarks/load.py                          # tiny-demo, 4 owners, 60 s per setup
    python benchmarks/load.py --quick --setups one     # tiny, 2 owners, 4 s: the smoke test
    python benchmarks/load.py --owners 8 --seconds 120 --json load.json

Each setup serves ``--model`` U-shape (``--cuts``) with per-owner LoRA adapters (``--lora-r``:
owners train their own adapters on a frozen base, so their steps never wait for one another's
and replicas agree without talking), one torch thread per server process:

- ``one``: ``python -m splitlearn.server`` on loopback;
- ``two``: ``python -m splitlearn.cluster --replicas 2`` (docs/CLUSTER.md): two such servers
  behind HAProxy, the owners' client ids chosen so that each replica gets half of them (by
  the ``X-Splitlearn-Replica`` answer header for each owner's own route).

The owners are ``--owners`` tenants of one token file (``owner<i> <token>``,
docs/SECURITY.md). Locust (:file:`locustfile.py`, headless, one user per owner, no think
time) drives them for ``--seconds``: each owner draws generation (session, prefill, decode
steps, close) or a training step (forward, backward, and the apply of an open-ended step) by
weight, over the raw protocol, tensors as safetensors. Meanwhile every server process's
VmRSS is sampled (``/proc/<pid>/status``; the replicas' pids from the run dir's
``replicas.json``, read at each sample so a restarted replica is followed).

Reported per setup: per operation requests, failures, p50 / p99 / max (ms, Locust's
percentiles: whole ms below 100 ms) and requests/s (decode steps/s and training steps/s in
the table); errors (failed requests plus exceptions in the users: the target is 0); each
server process's RSS in MiB before the load, a quarter into it, at its peak and at the end,
with the growth from the quarter to the end. ``--json`` writes it all, RSS traces included.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.procs.localserver import LocalServer, free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SETUPS = {"one": "one server", "two": "two replicas (HAProxy)"}


def write_tokens(path: Path, owners: int) -> list[str]:
    """A token file of ``owners`` tenants ``owner<i>``, mode 0600; their tokens."""
    tokens = [secrets.token_urlsafe(24) for _ in range(owners)]
    path.write_text("".join(f"owner{i} {t}\n" for i, t in enumerate(tokens)))
    path.chmod(0o600)
    return tokens


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:  # the process is gone (a replica restarting)
        pass
    return None


class RssSampler(threading.Thread):
    """VmRSS of the processes ``pids()`` names, every ``every_s`` seconds, until stopped."""

    def __init__(self, pids, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.pids, self.every_s, self.samples = pids, every_s, {}
        self.done = threading.Event()

    def sample(self) -> None:
        t = time.monotonic()
        for name, pid in self.pids().items():
            kib = rss_kib(pid)
            if kib is not None:
                self.samples.setdefault(name, []).append((t, kib))

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            self.sample()

    def summary(self, load_start: float, load_s: float) -> dict:
        """Per process, MiB: before the load (the last sample before ``load_start``), a quarter
        into it (warmed up: adapters made, caches allocated), peak, end, the growth from the
        quarter to the end (%), and the trace ([seconds into the load, MiB])."""
        out = {}
        for name, s in self.samples.items():
            mib = [(round(t - load_start, 1), round(k / 1024, 1)) for t, k in s]
            before = [m for t, m in mib if t < 0] or [mib[0][1]]
            warm = next((m for t, m in mib if t >= load_s / 4), mib[-1][1])
            out[name] = {"before": before[-1], "warm": warm, "peak": max(m for _, m in mib), "end": mib[-1][1],
                         "growth_pct": round(100 * (mib[-1][1] - warm) / warm, 1), "samples": len(mib),
                         "trace": mib}
        return out


def run_locust(url: str, token_file: Path, client_ids: list[str], a, out: Path) -> dict:
    """Locust headless against ``url`` for ``a.seconds``; the locustfile's report."""
    report = out / "locust.json"
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless",
           "-u", str(a.owners), "-r", str(a.owners), "-t", f"{a.seconds}s", "--stop-timeout", "30",
           "--host", url, "--only-summary", "--loglevel", "WARNING", "--token-file", str(token_file),
           "--client-ids", ",".join(client_ids), "--report-json", str(report),
           "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens),
           "--batch", str(a.batch), "--seq", str(a.seq),
           "--gen-weight", str(a.gen_weight), "--train-weight", str(a.train_weight)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.seconds + 300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode not in (0, 1) or not report.is_file():  # 1: some request failed (reported)
        raise SystemExit(f"locust failed (exit code {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(report.read_text())


def server_args(a, token_file: Path) -> list[str]:
    cuts = [x for c in a.cuts.split(",") for x in ("--cut", c)]
    return ["--model", a.model, *cuts, "--token-file", str(token_file), "--lora-r", str(a.lora_r),
            "--lora-targets", "c_attn,c_proj", "--torch-threads", "1"]


def one_server(a, token_file: Path, tokens: list[str], tmp: Path, measure) -> dict:
    with LocalServer(server_args(a, token_file), env={"OMP_NUM_THREADS": "1"}) as srv:
        return measure(srv.url, ["owner"] * a.owners, lambda: {"server": srv.proc.pid})


def two_replicas(a, token_file: Path, tokens: list[str], tmp: Path, measure) -> dict:
    run_dir, port = tmp / "cluster", free_port()
    manifest = run_dir / "replicas.json"
    cmd = [sys.executable, "-m", "splitlearn.cluster", "--replicas", "2", "--port", str(port),
           "--run-dir", str(run_dir), "--log-level", "WARNING",
           "--", *server_args(a, token_file), "--log-level", "WARNING"]
    env = {k: v for k, v in os.environ.items() if k != "SPLITLEARN_TOKEN"}
    proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (manifest.is_file() and all(r["ready"] for r in json.loads(manifest.read_text())["replicas"])):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the cluster did not start (exit code {proc.poll()}); logs in {run_dir}")
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        ids, placed = balanced_ids(url, tokens)

        def pids() -> dict:
            try:
                return {r["name"]: r["pid"] for r in json.loads(manifest.read_text())["replicas"]}
            except (OSError, ValueError):  # replaced right now: the next sample reads it
                return {}

        result = measure(url, ids, pids)
        result["owners_per_replica"] = placed
        result["replica_restarts"] = sum(r["restarts"] for r in json.loads(manifest.read_text())["replicas"])
        return result
    finally:
        proc.terminate()
        proc.wait(120)


def balanced_ids(url: str, tokens: list[str]) -> tuple[list[str], dict]:
    """A client id per owner such that each replica serves half of the owners: HAProxy
    routes by the hash of the Authorization header and the client id, so ask it."""
    want, placed, ids = -(-len(tokens) // 2), {}, []
    for token in tokens:
        for k in range(200):
            cid = f"owner{k}"
            req = urllib.request.Request(url + P.HEALTH, headers={
                "Authorization": f"Bearer {token}", P.ROUTE_HEADER: P.route_key(token, cid)})
            with urllib.request.urlopen(req, timeout=10) as r:
                name = r.headers[P.REPLICA_HEADER]
            if placed.get(name, 0) < want:
                placed[name] = placed.get(name, 0) + 1
                ids.append(cid)
                break
        else:
            raise SystemExit("could not place the owners evenly on the replicas")
    return ids, placed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/load.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 owners, 4 s: the smoke test")
    p.add_argument("--setups", default="one,two", help="comma-separated: one (one server), two (two replicas)")
    p.add_argument("--owners", type=int, default=4, help="data owners: tenants, one Locust user each")
    p.add_argument("--seconds", type=int, default=60, help="load per setup")
    p.add_argument("--model", default="tiny-demo")
    p.add_argument("--cuts", default="2,4", help="the U-shape's two cuts")
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per generation")
    p.add_argument("--batch", type=int, default=4, help="training rows per step")
    p.add_argument("--seq", type=int, default=64, help="training positions per row")
    p.add_argument("--gen-weight", type=int, default=1, help="how often an owner picks generation ...")
    p.add_argument("--train-weight", type=int, default=1, help="... against a training step")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.cuts, a.owners, a.seconds, a.seq, a.new_tokens = "tiny", "1,3", 2, 4, 16, 8
    setups = [s for s in a.setups.split(",") if s]
    if not setups or set(setups) - set(SETUPS):
        p.error(f"--setups: choose from {', '.join(SETUPS)}")
    if a.owners < 1 or a.seconds < 1:
        p.error("--owners and --seconds must be positive")

    results = []
    with tempfile.TemporaryDirectory(prefix="splitlearn-load-") as tmp_s:
        tmp = Path(tmp_s)
        token_file = tmp / "tokens.txt"
        tokens = write_tokens(token_file, a.owners)
        for setup in setups:
            out = tmp / setup
            out.mkdir()

            def measure(url: str, ids: list[str], pids) -> dict:
                sampler = RssSampler(pids)
                sampler.sample()
                sampler.start()
                t0 = time.monotonic()
                rep = run_locust(url, token_file, ids, a, out)
                sampler.done.set()
                sampler.join()
                sampler.sample()
                return {"setup": setup, "name": SETUPS[setup], **rep, "rss_mib": sampler.summary(t0, a.seconds),
                        "errors_total": sum(e["count"] for e in rep["errors"] + rep["exceptions"])}

            run = one_server if setup == "one" else two_replicas
            results.append(run(a, token_file, tokens, tmp, measure))
    report = {"command": " ".join(["python benchmarks/load.py", *(argv if argv is not None else sys.argv[1:])]),
              "config": {k: v for k, v in vars(a).items() if k != "json"}, "cpus": os.cpu_count(),
              "setups": results}
    print(markdown(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["errors_total"] == 0 for r in results) else 1


def markdown(report: dict) -> str:
    c, rows = report["config"], report["setups"]
    lines = [f"{c['model']} U-shape ({c['cuts']}), LoRA r={c['lora_r']}, {c['owners']} owners, {c['seconds']} s "
             f"per setup, {report['cpus']} cores",
             "", "| operation | " + " | ".join(f"{r['name']}: requests, p50 / p99 ms" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    names = sorted({o["op"] for r in rows for o in r["ops"]}, key=_order)
    for name in names:
        cells = []
        for r in rows:
            o = next((o for o in r["ops"] if o["op"] == name), None)
            cells.append("-" if o is None else f"{o['requests']}, {o['p50_ms']:.0f} / {o['p99_ms']:.0f}"
                         + (f" ({o['failures']} failed)" if o["failures"] else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for label, op in (("decode steps/s", "decode"), ("training steps/s", "train backward")):
        lines.append(f"| {label} | " + " | ".join(
            f"{next((o['rps'] for o in r['ops'] if o['op'] == op), 0):.1f}" for r in rows) + " |")
    lines.append("| errors | " + " | ".join(str(r["errors_total"]) for r in rows) + " |")
    for r in rows:
        rss = ", ".join(f"{n} {v['before']:.0f} before, {v['warm']:.0f} at 1/4, peak {v['peak']:.0f}, "
                        f"end {v['end']:.0f} ({v['growth_pct']:+.1f}% from 1/4)" for n, v in r["rss_mib"].items())
        lines.append(f"\n{r['name']}: RSS MiB {rss}")
        for e in r["errors"] + r["exceptions"]:
            lines.append(f"  - {e.get('op', 'exception')}: {e['error']} (x{e['count']})")
    return "\n".join(lines)


_OPS = ["session open", "prefill", "decode", "close", "train forward", "train backward", "train apply"]


def _order(name: str):
    return (_OPS.index(name), name) if name in _OPS else (len(_OPS), name)


if __name__ == "__main__":
    sys.exit(main())
