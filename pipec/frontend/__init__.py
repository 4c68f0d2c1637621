"""The front end: the user's model file, its traced graph, and what every node costs.

| module | owns |
|---|---|
| ``loader.py`` | the model-file contract: import the file, check what it defines (``ModelSpec``) |
| ``fakedevice.py`` | fake tensors of the plan's device type: the trace takes its branches |
| ``trace.py`` | the graph, by torch.fx or torch.export (``Traced``), and the output's structure |
| ``tensors.py`` | the tensors inside a value's containers |
| ``costgraph.py`` | the cost graph's records: per node and per cut (``CostGraph``) |
| ``kernels.py`` | the matrix products and convolutions a node runs |
| ``node_costs.py`` | each node's FLOPs and saved bytes, counted on meta tensors |
| ``inplace.py`` | in-place operations: which node overwrites which value |
| ``liveness.py`` | the values that cross each cut, and where a boundary may sit |
| ``autocast.py`` | what bf16 autocast changes in the graph, found without running it |
| ``annotate.py`` | the annotate pass: all of the above as one ``CostGraph`` |
| ``normalization.py`` | BatchNorm's rewrite for the plan's parallelism (``plan_norms``) |
| ``shardable.py`` | tensor-parallel regions: column and row linears (``find_shardable``) |
"""

from pipec.frontend.annotate import CostGraph, annotate
from pipec.frontend.loader import ModelSpec, load_model_file
from pipec.frontend.normalization import NormPlan, plan_norms, resolve_norm
from pipec.frontend.shardable import Shardable, find_shardable
from pipec.frontend.trace import Traced, trace_model

__all__ = ["CostGraph", "ModelSpec", "NormPlan", "Shardable", "Traced", "annotate",
           "find_shardable", "load_model_file", "plan_norms", "resolve_norm", "trace_model"]
