"""The PipecError family: user errors, reported as one line on stderr with exit status 2."""

from __future__ import annotations


class PipecError(Exception):
    """A mistake in the user's input; the message states the numbers and the fix."""

    exit_code = 2


class ModelFileError(PipecError):
    """The model file is missing, does not import, or breaks the model-file contract."""


class TraceError(PipecError):
    """The model cannot be traced by the chosen front end."""


class ConfigError(PipecError):
    """Inconsistent command-line options (device counts, batch sizes, names)."""


class InfeasibleError(PipecError):
    """No plan fits the devices' memory."""


class OutputError(PipecError):
    """The output directory cannot be written safely."""


class MetricsError(PipecError):
    """A metrics file that is missing, malformed, or from another plan."""


class ExportError(PipecError):
    """A stage the ONNX exporter cannot handle."""
