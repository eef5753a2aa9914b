"""Compare the lock (constraints.txt) with what a venv holds; optionally rewrite the lock from it.

    python tools/lockdiff.py constraints.txt .venv-latest           # print what differs
    python tools/lockdiff.py constraints.txt .venv-latest --write   # the lock becomes the venv's

The lock keeps its comment header and its build tools (pip, setuptools, uv) at the venv's versions;
torch stays at the version the Makefile installs first (2.13.0: the CPU build on disk); a package
in :data:`HELD` keeps its locked version, for the reason given there.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

BUILD = ("pip", "setuptools", "uv")  # the build tools the lock pins first
RUNTIME = "# Runtime and test dependencies:"
TORCH = "2.13.0"  # installed first by the Makefile, never upgraded by the lock
# held back from the newest release, and why (a --write keeps the locked version)
HELD = {
    # requests imports chardet at its own import when it is installed (lm-eval's mbstrdecoder pulls
    # it in, admitting chardet<7); 6.0's import takes 2.5 s on a 2-core VM (5.2.0: 0.5 s for all of
    # requests), paid by every client process and every test that starts one
    "chardet": "5.2.0",
}
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def venv_pins(venv: Path) -> dict[str, tuple[str, str]]:
    """{normalised name: (name as pip spells it, version)} of what ``venv`` holds (editables left out)."""
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze",
                          "--exclude-editable"], check=True, capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        m = PIN.match(line.strip())
        if m:
            pins[_norm(m.group(1))] = (m.group(1), m.group(2).split("+")[0])
    return pins


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("lock", type=Path)
    ap.add_argument("venv", type=Path)
    ap.add_argument("--write", action="store_true", help="rewrite the lock with the venv's versions")
    args = ap.parse_args(argv)
    locked, have = read_lock(args.lock), venv_pins(args.venv)
    changed = [(have[k][0], locked.get(k), have[k][1]) for k in sorted(have)
               if k != "torch" and locked.get(k) != have[k][1]]
    gone = sorted(k for k in locked if k not in have and k != "torch")
    print(f"newest admitted releases vs {args.lock}: "
          f"{len(changed)} differ, {len(gone)} no longer needed")
    for name, old, new in changed:
        print(f"  {name}: {old or '(new)'} -> {new}")
    for name in gone:
        print(f"  {name}: {locked[name]} -> (not installed)")
    if args.write:
        header = []  # the comment lines before the first pin, the runtime section's heading left out
        for line in args.lock.read_text().splitlines():
            if PIN.match(line):
                break
            if line != RUNTIME:
                header.append(line)
        build = [f"{k}=={have[k][1]}" for k in BUILD if k in have]
        body = [f"{have[k][0]}=={HELD.get(k, have[k][1])}" for k in sorted(have) if k not in BUILD and k != "torch"]
        args.lock.write_text("\n".join(header + build + [RUNTIME] + body + [f"torch=={TORCH}"]) + "\n")
        print(f"wrote {args.lock} ({len(build) + len(body) + 1} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
