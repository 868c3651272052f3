"""graph_opt: CUDA-graph capture and replay per batch size."""
