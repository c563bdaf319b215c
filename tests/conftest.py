import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # ir_cases, backend_check
# two logical CPU devices (cpu:0, cpu:1) so that migration and multi-device tests have somewhere to go;
# "cpu" names cpu:0
os.environ.setdefault("JITLLM_CPU_DEVICES", "2")


def backend_device(name):
    """The named device, or skip with the backend's own reason for having none."""
    from jitllm_core import registry
    try:
        return registry.device(name)
    except Exception:
        pass
    backend = name.split(":")[0]
    why = [s["reason"] for s in registry.backend_status() if s["name"] == backend]
    pytest.skip(f"no {name}: {why[0] if why else 'backend plugin not installed'}")


@pytest.fixture(scope="session")
def cpu():
    return backend_device("cpu")


@pytest.fixture(scope="session")
def default_model():
    from jitllm_core.models import default_model_path
    return default_model_path()
