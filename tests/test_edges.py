"""Edges of issue #25: bad ``run`` arguments, huge replica counts, a refused thread pool.

Each failed before its fix: ``kwargs=[1]`` killed the interpreter (SIGSEGV, the C replica engine),
512 replicas raised RecursionError at the first all-reduce, and a ``set_num_threads`` whose thread
creation the system refused left the threads it had started running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cudist

def _in_subprocess(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (a crash there is a failure here, not a lost suite)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


@pytest.mark.parametrize("kwargs", [[1], "ab", 3, (("a", 1),), np.ones(2)])
def test_run_refuses_a_kwargs_that_is_not_a_mapping(kwargs, replica_execution):
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(TypeError, match="kwargs must be a mapping"):
        s.run(lambda **k: 1, kwargs=kwargs)


def test_run_refuses_keyword_names_that_are_not_strings():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(TypeError, match="keys must be strings"):
        s.run(lambda **k: 1, kwargs={1: 2})


def test_run_takes_any_mapping_as_kwargs():
    import types

    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = s.run(lambda a, b: a + b, kwargs=types.MappingProxyType({"a": 1, "b": 2}))
    assert out == 3


def test_bad_kwargs_do_not_crash_the_interpreter():
    r = _in_subprocess("""
        import cudist
        from cudist import config
        cpu = config.list_physical_devices("CPU")[0]
        config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 2)
        s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
        for mode in ("greenlets", "threads", "auto"):
            config.set_replica_execution(mode)
            for kw in ([1], "ab", 3, object()):
                try:
                    s.run(lambda **k: 1, kwargs=kw)
                except TypeError:
                    pass
        print("survived")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "survived", r.stdout + r.stderr


def test_512_replicas_all_reduce_in_every_mode():
    r = _in_subprocess("""
        import cudist
        from cudist import config
        cpu = config.list_physical_devices("CPU")[0]
        config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 512)
        s = cudist.MirroredStrategy()
        assert s.num_replicas_in_sync == 512
        for mode in ("greenlets", "auto", "threads"):
            config.set_replica_execution(mode)
            out = s.run(lambda: cudist.get_replica_context().all_reduce("sum", 1.0))
            got = {float(v) for v in s.experimental_local_results(out)}
            assert got == {512.0}, got
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-2000:]


def test_refused_thread_creation_leaves_no_thread_running():
    """Under an address-space limit that lets only some thread stacks be mapped, set_num_threads
    fails cleanly: the pool keeps its size and the threads it had started are gone."""
    r = _in_subprocess("""
        import os, resource
        from cudist._kernels import _native

        _native.set_num_threads(2)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        before = tasks()
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        try:
            _native.set_num_threads(1024)  # 8 MiB stacks: a few dozen fit in 256 MiB
        except RuntimeError as e:
            assert "refused to start a thread" in str(e) and "keep 2 thread(s)" in str(e), e
        else:
            raise AssertionError("1024 threads started under a 256 MiB address-space margin")
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert _native.num_threads() == 2, _native.num_threads()
        assert tasks() == before, (tasks(), before)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-2000:]
