#!/usr/bin/env bash
# The test suite (CPU tests with simulated graphs; tests/gpu runs where CUDA is present).
# Installs what it needs on first use. Extra arguments go to pytest. With pytest-xdist installed (the
# dev extra) the tests run in two worker processes, as many as CI's cores, each test file in one of
# them (its module fixtures run once), heaviest files first (tests/conftest.py); -n, --pdb or
# -p no:xdist among the arguments turn that off.
set -euo pipefail
EXTRA=dev
source "$(dirname "$0")/scripts/python-env.sh"
WORKERS=(-n 2 --dist loadfile --no-loadscope-reorder)
case " $* " in
    *" -n "* | *" -n="* | *" --numprocesses"* | *" --pdb"* | *"no:xdist"*) WORKERS=() ;;
esac
if [ ${#WORKERS[@]} -gt 0 ] && ! "$PY" -c "import xdist" >/dev/null 2>&1; then
    WORKERS=()
fi
exec "$PY" -m pytest -q ${WORKERS[@]+"${WORKERS[@]}"} "$@"
