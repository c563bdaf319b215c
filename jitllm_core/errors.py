"""Errors jitllm raises on purpose: each names what was wrong and where."""
import numbers


class JitllmError(Exception):
    """Base of every error the engine raises deliberately."""


class ModelFileError(JitllmError):
    """A model file is unreadable, malformed or unsupported; the message names the file."""

    def __init__(self, path, problem):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


class BackendError(JitllmError):
    """A backend or device cannot do what was asked (no driver, out of memory, compile failure)."""


class ContextLimitError(JitllmError):
    """The sequence reached the model's (or engine's) context length."""


def check_whole(name, value, least):
    """Refuse a parameter that is not a whole number >= least (a bool, a float, a string), naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise JitllmError(f"{name} must be a whole number >= {least}, not {value!r}")
