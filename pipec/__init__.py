"""pipec: a static partition-and-codegen compiler for pipeline-parallel PyTorch training."""

__version__ = "0.1.0"
