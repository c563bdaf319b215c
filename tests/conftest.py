import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # ir_cases, backend_check
sys.path.insert(1, str(Path(__file__).parent / "device"))  # cut_model
# two logical CPU devices (cpu:0, cpu:1) so that migration and multi-device tests have somewhere to go;
# "cpu" names cpu:0
os.environ.setdefault("JITLLM_CPU_DEVICES", "2")


def missing(backend, why, module=False):
    """Skip a test that needs `backend` -- or fail it, when JITLLM_REQUIRE_BACKENDS names that backend (as
    scripts/test.sh does for the backends its set-up installs), so that a broken install cannot pass as skips."""
    required = [b for b in os.environ.get("JITLLM_REQUIRE_BACKENDS", "").split(",") if b]
    if backend in required:
        pytest.fail(why)
    pytest.skip(why, allow_module_level=module)


def backend_device(name):
    """The named device, or skip (see `missing`) with the backend's own reason for having none."""
    from jitllm_core import registry
    try:
        return registry.device(name)
    except Exception:
        pass
    backend = name.split(":")[0]
    why = [s["reason"] for s in registry.backend_status() if s["name"] == backend]
    missing(backend, f"no {name}: {why[0] if why else 'backend plugin not installed'}")


@pytest.fixture(scope="session")
def cpu():
    return backend_device("cpu")


@pytest.fixture(scope="session")
def default_model():
    from jitllm_core.models import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def shallow_model(default_model, tmp_path_factory):
    """The default model cut to its first 2 layers (tokenizer, embedding and head whole): for what each layer's
    kernels show as well as thirty do (a batched step's rows bit for bit its sequences' steps), where lavapipe
    takes minutes over the whole model on a slow host."""
    from cut_model import cut
    out = tmp_path_factory.mktemp("shallow") / "smollm2-2-layers.gguf"
    cut(default_model, out, 2)
    return str(out)
