"""The graph recorders (contracts.Recorder): the device's CUDA graphs, and the host stand-in that runs
the whole capture/replay state machine where CUDA graphs cannot (graph_opt.testing's switch)."""
