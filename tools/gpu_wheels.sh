#!/bin/sh
# The wheels a lent GPU machine lacks, into .whl/ (gitignored), for benchmarks/gpu_session.sh.
#
# Its image has Python 3.12, torch 2.11+cu130, an older transformers and no registry it can
# reach; splitlearn runs there from the source tree with these on PYTHONPATH, each at the
# version constraints.txt pins. fvcore and iopath are sdists: built into wheels here.
# Run from anywhere: `make gpu-wheels` (or sh tools/gpu_wheels.sh); PY picks the interpreter.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BINARY="transformers tokenizers Flask Werkzeug waitress blinker itsdangerous peft termcolor yacs"
SDIST="fvcore iopath"
pins() {  # NAME==VERSION of each name, from constraints.txt
    for name in "$@"; do
        grep -i -E "^${name}==" constraints.txt || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
    done
}
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2046
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(pins $BINARY)
# shellcheck disable=SC2046
$PY -m pip wheel -q --no-deps -w .whl $(pins $SDIST)
ls .whl
du -sh .whl  # it travels with the working tree: 64 MiB a call in all
