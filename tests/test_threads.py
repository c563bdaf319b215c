"""Several threads on one CPU device: the same results as one thread, bit for bit (each parallel iteration is
computed whole by one thread), including the barriers the runtime leaves out between independent launches."""
import numpy as np
import pytest

import jitllm_core as jl
from backend_check import assert_matches_interpreter
from conftest import backend_device
from ir_cases import CASES, inputs_for


@pytest.fixture
def two_threads():
    dev = backend_device("cpu:1")
    before = dev.threads
    dev.configure(threads=2)
    yield dev
    dev.configure(threads=before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ir_cases_with_two_threads(two_threads, case):
    build, scalars = CASES[case]
    k = build()
    assert_matches_interpreter(two_threads, k, inputs_for(k), scalars)


def test_model_logits_independent_of_thread_count(default_model, two_threads):
    eng = jl.Engine(default_model, devices=["cpu:1"])
    ids = eng.tokenizer.encode("Threads must not change a single bit of the result, said the compiler.") * 2
    two = eng.score(ids)
    out2 = eng.generate(ids[:20], max_tokens=12, ignore_eos=True).token_ids
    two_threads.configure(threads=1)
    one = eng.score(ids)
    out1 = eng.generate(ids[:20], max_tokens=12, ignore_eos=True).token_ids
    eng.close()
    assert np.array_equal(one, two) and out1 == out2
