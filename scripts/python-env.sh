#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: sets $PY to a Python that has what the caller needs. The caller sets
# EXTRA first: `demo` (numpy, pyyaml, tqdm, paddlepaddle==3.3.1 and torch==2.13.0, CPU builds) or `dev`
# (the demo's, and pytest, pytest-xdist, transformers, and PaddleFormers for one test).
#
# - A machine whose python3 already has CUDA-enabled PyTorch (a GPU box, often without network) uses
#   that interpreter as it is, with the checkout on PYTHONPATH.
# - Otherwise a .venv is created once and `pip install -e .[$EXTRA]` runs. Each step reruns only when
#   its stamp is missing or pyproject.toml is newer; a dev install serves the demo too.
# PYTHON=/path/to/python overrides both.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRA="${EXTRA:-dev}"
case "$EXTRA" in
    demo | dev) ;;
    *) echo "scripts/python-env.sh: EXTRA=$EXTRA: expected demo or dev" >&2; exit 2 ;;
esac

has_deps() {
    local modules="numpy, yaml, tqdm"
    [ "$EXTRA" = dev ] && modules="$modules, pytest"
    "$1" -c "import $modules" >/dev/null 2>&1
}
installed() { [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]; }

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
elif python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 \
        && has_deps python3; then
    PY="$(command -v python3)"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    echo "graph_opt: using $PY (CUDA PyTorch found; nothing installed)" >&2
else
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    if ! installed ".venv/.graph_opt-installed-dev" && { [ "$EXTRA" = dev ] || ! installed ".venv/.graph_opt-installed-demo"; }; then
        echo "graph_opt: installing .[$EXTRA] into .venv (once)" >&2
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet -e ".[$EXTRA]"
        touch ".venv/.graph_opt-installed-$EXTRA"
    fi
    # PaddleFormers for tests/models/test_paddleformers.py alone, in a folder of its own that only that
    # test's process puts on its path (it pins an older transformers; a plain install also pulls ~90
    # packages and paddlecodec, which breaks transformers' torch models)
    PF="tests/models/paddleformers/requirements.txt"
    PF_STAMP=".venv/paddleformers/.installed"
    if [ "$EXTRA" = dev ] && { [ ! -f "$PF_STAMP" ] || [ "$PF" -nt "$PF_STAMP" ]; }; then
        echo "graph_opt: installing PaddleFormers into .venv/paddleformers (once)" >&2
        rm -rf .venv/paddleformers
        .venv/bin/python -m pip install --quiet --no-deps --target .venv/paddleformers -r "$PF"
        touch "$PF_STAMP"
    fi
    PY="$ROOT/.venv/bin/python"
fi
export PY
