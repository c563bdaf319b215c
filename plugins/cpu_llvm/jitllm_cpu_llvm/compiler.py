"""LLVM for this CPU: its target machine, -O3, and the compile of a module (a kernel's or a program's step) to object
code -- which runs in processes of its own (`compile_object`), as many modules at once as there are cores to spare.

Why processes: llvmlite holds one lock around every call into LLVM, so threads compile one module at a time, and the
machine scheduler is a process-wide option set per module. A process compiles one module at a time with its own
option and lock; the object code it sends back, written to the cache, is what a warm start loads (runtime.Compiled),
and an LLVM crash there breaks that process, not the engine's.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path

import llvmlite.binding as llvm

_local = threading.local()  # a thread's pass builder, and in the parent its compile process
_in_process = threading.Lock()  # modules compiled in this process (Compilers, without processes): one at a time


@functools.cache
def host():
    """(triple, CPU name, feature string, features) of this machine, asked of LLVM once: LLVM's binding calls share
    one lock, which a module's code generation holds for seconds, and lowering must not wait for it."""
    feats = llvm.get_host_cpu_features()
    return llvm.get_process_triple(), llvm.get_host_cpu_name(), feats.flatten(), dict(feats)


def target_machine(cpu=None):
    """A fresh target machine for this CPU, or for the CPU LLVM names cpu (its own features): the pass builder and
    each MCJIT engine take ownership of theirs."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    triple, host_cpu, host_features, _ = host()
    name, features = (cpu, "") if cpu else (host_cpu, host_features)
    return llvm.Target.from_triple(triple).create_target_machine(cpu=name, features=features, opt=3)


def optimize(mod, tm=None):
    """LLVM's -O3 on mod, for this CPU or for target machine tm (assembly.py's named CPUs), once its support's
    always-inline functions are inlined (a kernel's prefetches: the passes see them as if lowered in place, a call
    of one that prefetches nothing not at all)."""
    if tm is None:
        if getattr(_local, "passes", None) is None:
            _local.passes = _pass_builder(target_machine())
        passes = _local.passes
    else:
        passes = _pass_builder(tm)
    inline = llvm.create_new_module_pass_manager()
    inline.add_always_inliner_pass()
    inline.run(mod, passes)
    passes.getModulePassManager().run(mod, passes)


def _pass_builder(tm):
    return llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))


def machine_scheduler(on):
    """Whether the next code generation in this process runs LLVM's machine scheduler (a process-wide option)."""
    llvm.set_option("", f"-enable-misched={'true' if on else 'false'}")


def compile_object(text, support, schedule):
    """In a compile process: the module's object code for this CPU as MCJIT makes it. LLVM's parse, verify and code
    generation errors are raised as RuntimeError."""
    mod = llvm.parse_assembly(text)
    mod.link_in(llvm.parse_assembly(support))  # the support functions' IR
    mod.verify()
    optimize(mod)
    machine_scheduler(schedule)
    engine, made = llvm.create_mcjit_compiler(mod, target_machine()), []
    engine.set_object_cache(lambda _mod, buf: made.append(buf), lambda _mod: None)
    engine.finalize_object()
    return made[0]


def outcome(job):
    """`compile_object(*job)`'s outcome as a compile process answers it: (the object code, None), or (None, its
    error's text) -- the same wherever the module compiled."""
    try:
        return compile_object(*job), None
    except Exception as e:  # noqa: BLE001 (any error is the module's answer; the process serves the next)
        return None, str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"


class Crashed(Exception):
    """A compile process ended without an answer (LLVM aborted on the module, or the process was killed)."""


class Compilers:
    """Compile processes (this file run as a script: it imports no more than llvmlite, so a process starts in a
    fifth of a second, not half of one), each fed by a thread of the engine's process that sends it one module at
    a time: `submit` returns a future done once its object code is written to `path` (by `write`). Plain
    processes, not multiprocessing's, which would import the user's main script again in each. Started at the
    first module a cold cache leaves to compile; a process that crashed is started anew for the next module.
    Where no process can be started (no Python executable to run: an embedded interpreter), modules compile in
    this process, one at a time."""

    def __init__(self, n, write):
        self.pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="jitllm-compile")
        self.write = write

    def submit(self, text, support, schedule, path):
        return self.pool.submit(self._compile, (text, support, schedule), Path(path))

    def _compile(self, job, path):
        proc = getattr(_local, "proc", None)
        if proc is None or proc.poll() is not None:
            try:
                proc = _local.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                                      stdout=subprocess.PIPE)
            except OSError:
                proc = None
        if proc is None:
            with _in_process:
                obj, error = outcome(job)
        else:
            try:
                _send(proc.stdin, job)
                obj, error = _receive(proc.stdout)
            except (OSError, EOFError) as e:
                proc.kill()
                raise Crashed(f"the compile process ended (exit status {proc.wait()})") from e
        if error is not None:
            raise RuntimeError(error)
        try:
            self.write(path, obj)
        except OSError as e:  # the cache's error (a full disk): the module's answer, as LLVM's are
            raise RuntimeError(f"{type(e).__name__}: {e}") from None


def _send(f, obj):
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _receive(f):
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    data = f.read(n) if n >= 0 else b""
    if len(data) != n:
        raise EOFError  # the other end is gone
    return pickle.loads(data)


def serve():
    """A compile process: modules from stdin, each answered on stdout with its `outcome`; stdout is the answers'
    alone (whatever else would print there goes to stderr)."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        try:
            job = _receive(requests)
        except EOFError:  # the engine's process is gone
            return
        _send(answers, outcome(job))


if __name__ == "__main__":
    serve()
