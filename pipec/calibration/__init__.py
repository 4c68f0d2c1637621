"""Measurements on this machine's devices that the cost model's constants are fitted to.

| module | owns |
|---|---|
| ``by_default.py`` | ``--measure auto``: time the model here once and cache it |
| ``blocks.py`` | a model too large to build whole, timed block by block |
| ``profile.py`` | ``pipec profile``: per-node times at several micro-batch sizes, and their fits |
| ``step_times.py`` | the loss, the data and the optimizer a step runs besides the model |
| ``split_backward_times.py`` | what a zero-bubble schedule's split backward adds |
| ``norm_times.py`` | BatchNorm's own time where a profile timed GroupNorm |
| ``probe.py`` | the pipelining runtime's own terms, measured on real processes |
| ``gpu_probe.py`` | links, all-reduce and the runtime's own time on this machine's GPUs |
| ``action_times.py`` | per-action overhead of the pipelining runtime |
| ``allreduce_times.py`` | data-parallel all-reduces |
| ``receive_times.py`` | a receive whose input was sent before it was asked for |
| ``relay.py`` | compute speed while only some processes compute |
| ``runtime_fit.py`` | the probe's measurements fitted to the cost model's terms |
| ``timers.py`` | wall-clock timing of a repeated run |
| ``heap.py`` | the host heap policy the emitted script runs under |
"""

from pipec.calibration.by_default import MEASURE_CHOICES, measure_locally
from pipec.calibration.profile import PROFILE_NORMS, profile_model

__all__ = ["MEASURE_CHOICES", "PROFILE_NORMS", "measure_locally", "profile_model"]
