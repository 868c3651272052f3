#!/usr/bin/env bash
# The demo: a small decoder in every mode of the mode table, on the GPU when one is present.
# Installs what it needs on first use (the demo extra: paddle and torch, no test tools). Extra arguments
# go to `python -m graph_opt demo`.
set -euo pipefail
EXTRA=demo
source "$(dirname "$0")/scripts/python-env.sh"
exec "$PY" -m graph_opt demo "$@"
