"""Demos and benchmarks (installed as graph_opt.benchmarks): the demo models and runner behind
`python -m graph_opt demo`, the CPU benchmarks behind `python -m graph_opt bench`, and the GPU
benchmark `python -m graph_opt.benchmarks.torch_gpu`. Not part of the runtime."""
