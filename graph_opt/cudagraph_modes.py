"""The values of cudagraph_mode: read by config.py (validation) and env.py (GRAPH_OPT_CUDAGRAPH_MODE)."""

CUDAGRAPH_MODES = ("full", "piecewise", "full_and_piecewise")
