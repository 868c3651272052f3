#!/usr/bin/env bash
# The test suite (CPU tests with simulated graphs; tests/gpu runs where CUDA is present).
# Installs what it needs on first use. Extra arguments go to pytest. With pytest-xdist installed (the
# dev extra) the tests run in two worker processes, as many as CI's cores; pass -n to choose.
set -euo pipefail
source "$(dirname "$0")/scripts/python-env.sh"
WORKERS=()
if "$PY" -c "import xdist" >/dev/null 2>&1 && [[ " $* " != *" -n "* ]]; then
    WORKERS=(-n 2)
fi
exec "$PY" -m pytest -q ${WORKERS[@]+"${WORKERS[@]}"} "$@"
