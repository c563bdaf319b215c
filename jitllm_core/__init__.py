"""jitllm: an LLM inference engine that JIT-compiles its kernels from one IR and moves layers between devices."""
from .errors import BackendError, ContextLimitError, JitllmError, ModelFileError
from .registry import devices


def __getattr__(name):  # the engine pulls in the tokenizer and model code; load it on first use
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "devices", "JitllmError", "ModelFileError", "BackendError", "ContextLimitError"]
