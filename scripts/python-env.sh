#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: sets $PY to a Python that has graph_opt's dependencies.
#
# - A machine whose python3 already has CUDA-enabled PyTorch (a GPU box, often without network) uses
#   that interpreter as it is, with the checkout on PYTHONPATH.
# - Otherwise a .venv is created once and `pip install -e .[dev]` runs (numpy, pyyaml, tqdm, pytest,
#   paddlepaddle==3.3.1 and torch==2.13.0, both CPU builds, transformers). It reruns only when
#   pyproject.toml changes. PaddleFormers goes into .venv/paddleformers (see below).
# PYTHON=/path/to/python overrides both.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

has_deps() { "$1" -c "import numpy, yaml, tqdm, pytest" >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
elif python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 \
        && has_deps python3; then
    PY="$(command -v python3)"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    echo "graph_opt: using $PY (CUDA PyTorch found; nothing installed)" >&2
else
    STAMP=".venv/.graph_opt-installed"
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
        echo "graph_opt: installing into .venv (once)" >&2
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet -e ".[dev]"
        touch "$STAMP"
    fi
    # PaddleFormers for tests/models/test_paddleformers.py, in a folder of its own that only that test's
    # process puts on its path (it pins an older transformers; a plain install also pulls ~90 packages
    # and paddlecodec, which breaks transformers' torch models)
    PF="tests/models/paddleformers/requirements.txt"
    PF_STAMP=".venv/paddleformers/.installed"
    if [ ! -f "$PF_STAMP" ] || [ "$PF" -nt "$PF_STAMP" ]; then
        echo "graph_opt: installing PaddleFormers into .venv/paddleformers (once)" >&2
        rm -rf .venv/paddleformers
        .venv/bin/python -m pip install --quiet --no-deps --target .venv/paddleformers -r "$PF"
        touch "$PF_STAMP"
    fi
    PY="$ROOT/.venv/bin/python"
fi
export PY
