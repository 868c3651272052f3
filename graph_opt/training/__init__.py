"""Training graphs: graph_opt.autocudagraph, a block's forward and backward each a CUDA graph (the block,
its keys' graphs and how they are recorded, what it watches of its module)."""
from .api import autocudagraph

__all__ = ["autocudagraph"]
