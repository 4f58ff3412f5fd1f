"""Errors the engine raises; each message names the offending value and the limit or fix."""


class EngineError(Exception):
    """Base class of every error raised by the inference engine."""


class InvalidRequestError(EngineError, ValueError):
    """A request or its sampling parameters are invalid; the engine keeps serving the others."""


class ModelLoadError(EngineError):
    """The model directory is missing files or holds an unsupported architecture."""


class WeightUpdateError(EngineError):
    """A weight update named an unknown parameter, had a wrong shape, or was incomplete."""


class EngineStateError(EngineError, RuntimeError):
    """An operation is not allowed in the engine's current lifecycle state (e.g. resume while asleep)."""
