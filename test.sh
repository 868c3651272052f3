#!/usr/bin/env bash
# The test suite (CPU tests with simulated graphs; tests/gpu runs where CUDA is present).
# Installs what it needs on first use. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/scripts/python-env.sh"
exec "$PY" -m pytest -q "$@"
