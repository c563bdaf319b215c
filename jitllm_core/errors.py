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


def is_whole(value) -> bool:
    """An integer of Python's or NumPy's, not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_whole(name, value, least):
    """Refuse a parameter that is not a whole number >= least (a bool, a float, a string), naming it."""
    if not is_whole(value) or value < least:
        raise JitllmError(f"{name} must be a whole number >= {least}, not {value!r}")
