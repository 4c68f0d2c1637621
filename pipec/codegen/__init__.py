"""Code generation: the plan as a standalone training script, a plan file and a report.

| module | owns |
|---|---|
| ``split.py`` | the split pass: each stage as an ``nn.Module`` class in Python source |
| ``local_shards.py`` | a tp rank's graph and weights (``parallel_graph``, ``local_weights``) |
| ``sequence_parallel.py`` | a tp rank's graph split along the sequence between its regions |
| ``emit.py`` | the emit pass: render ``templates/`` into the output directory |
| ``plan_file.py`` | ``plan.json``: the plan as data, with stable keys |
| ``report.py`` | the report's tables and the schedule timeline (SVG) |
| ``onnx_export.py`` | each stage as ONNX (``--onnx``) |
| ``output_dir.py`` | the output directory, written atomically |
"""

from pipec.codegen.emit import Emitted, emit
from pipec.codegen.local_shards import Collectives, local_weights, parallel_graph
from pipec.codegen.onnx_export import export_stages, require_onnx
from pipec.codegen.sequence_parallel import SequenceParallelError, sequence_split
from pipec.codegen.split import Staged, split

__all__ = ["Collectives", "Emitted", "SequenceParallelError", "Staged", "emit", "export_stages",
           "local_weights", "parallel_graph", "require_onnx", "sequence_split", "split"]
