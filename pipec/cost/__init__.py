"""The cost model: devices, and the time and memory of nodes, boundaries and stages.

| module | owns |
|---|---|
| ``hardware.py`` | device presets and topology (``Device``, ``load_devices``) |
| ``model.py`` | time and memory of nodes and boundaries at a micro-batch size; measured fits |
| ``stage_memory.py`` | what a stage holds at its peak |
| ``kernel_cache.py`` | the kernels a CPU's math library compiles and keeps |
| ``cores.py`` | processes that share a CPU's cores |
| ``calibration_file.py`` | a calibration as a JSON file (``pipec profile --out``) |
| ``sharded_costs.py`` | one tensor-parallel rank's costs and collectives (``shard_costs``) |
"""

from pipec.cost.calibration_file import load_calibration, save_calibration
from pipec.cost.hardware import Device, load_devices
from pipec.cost.model import Calibration, Training
from pipec.cost.sharded_costs import TpCosts, shard_costs

__all__ = ["Calibration", "Device", "TpCosts", "Training", "load_calibration", "load_devices",
           "save_calibration", "shard_costs"]
