"""How long a checkpoint save blocks the training loop: synchronous against ``CheckpointOptions(enable_async=True)``.

``python bench/async_checkpoint.py [MiB] [rounds] [steps] [optimizer]``: a model of float32
variables (8 of them) and their optimizer's slots, ``MiB`` in all (256 by default), trained by
``optimizer`` (``momentum``, the default: SGD with momentum; ``adamw``, ``nadam``: two slots each)
and saved by a ``CheckpointManager`` (fsync included) in rounds that alternate:

* sync: ``manager.save()``; the time the call takes is the time the loop is blocked;
* async: ``manager.save(options=CheckpointOptions(enable_async=True))``, then ``steps`` training
  steps while the background thread writes, then ``manager.sync()``. Blocked: the call, plus what
  the steps after it cost beyond the same steps without a save (the first step after the call
  writes every variable and slot out of place, or copies them first where its kernel cannot, and
  the background write competes for the cores), plus any wait left at ``sync()`` (none when the
  steps outlast the write).

* capture alone: the same asynchronous save with its background write held back until the steps
  are done (``_format.write_checkpoint`` waits): the call plus what the steps cost beyond plain
  ones is what capturing the state costs the loop, without the write competing for the cores.

The process's CPU time (all threads) during the asynchronous save and its steps, beyond that of the
plain steps, is the background write's own work: what it takes from the loop where no core is spare.

Extras are paired within a round (each round's steps against that round's plain steps), then the
median is taken. One asynchronous round runs before the measured ones: the first one faults in the buffers that the
later ones recycle.

Prints the medians over the rounds (ms) and the ratios to the synchronous save. The steps' own
time is measured in the same run, as is a plain copy of the same bytes (the copy-on-write's floor).

``python bench/async_checkpoint.py [MiB] [rounds] [steps] [optimizer] --every K [--saves S]``: the
loop as users run it, a save every ``K`` training steps (``K`` long enough for the write to end in
the background). Each round runs, in an order that rotates from round to round, the same loop of
``S`` x (save, ``K`` steps) (3 saves by default) four ways: without saves; with synchronous saves;
with asynchronous saves at the writer priority ``CUDIST_CHECKPOINT_WRITER_NICE`` gives (0, the
loop's own, unless set) and at nice 10 (or 0 if the variable sets another). An asynchronous loop ends with ``sync()``, so a write
that outlasts its ``K`` steps is paid for. Blocked per save = (loop time - the same round's loop
without saves) / ``S``, reported against the synchronous save (its call, timed in the same loops);
also how long each background write took from the save call to its commit.

``... --every K [--saves S] --ab``: the writer A/B (issue #29) in the same rotating rounds, instead
of the two priorities: the loop without saves; synchronous and asynchronous saves through the native
tensor writer as it is (``cudist._core.write_crc32`` per tensor through the page cache, no GIL:
``sync``, ``async``), with ``CUDIST_CHECKPOINT_DIRECT_IO=on`` (``O_DIRECT`` through a bounce buffer:
``... direct``) and through the Python loop they replaced (``os.write`` + CRC-32 per 1 MiB chunk:
``... python``); and ``memcpy``:
at each save point a thread copies the same number of bytes between two buffers faulted in once
(``np.copyto``, no GIL), joined before the next one: what the loop pays for the write's memory
traffic alone, with no file, no checksum and no GIL; ``spin``: a thread that burns as much CPU as
an ``async`` write's thread took (median so far), in a Numba ``nogil`` loop without memory
traffic (what that write's CPU alone costs the loop on this machine's cores). The last column is
each way's background thread CPU (``time.thread_time``, system time included).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import cudist
from cudist import _settings, train
from cudist.train import _format


def _option(args: list[str], flag: str, default: int | None) -> int | None:
    """Removes ``flag VALUE`` from ``args`` and returns VALUE as an int (``default`` if absent)."""
    if flag not in args:
        return default
    i = args.index(flag)
    value = int(args[i + 1])
    del args[i : i + 2]
    return value


def main() -> None:
    args = sys.argv[1:]
    ab = "--ab" in args
    if ab:
        args.remove("--ab")
    every = _option(args, "--every", None)
    saves = _option(args, "--saves", 3)
    mib = int(args[0]) if len(args) > 0 else 256
    rounds = int(args[1]) if len(args) > 1 else 5
    steps = int(args[2]) if len(args) > 2 else 10
    name = args[3] if len(args) > 3 else "momentum"
    make, nslots = {
        "momentum": (lambda: cudist.optimizers.SGD(0.01, momentum=0.9), 1),
        "adamw": (lambda: cudist.optimizers.AdamW(0.001), 2),
        "nadam": (lambda: cudist.optimizers.Nadam(0.001), 2),
    }[name]
    nvars = 8
    n = (mib << 18) // (nvars * (1 + nslots))  # float32 elements per variable: MiB in all, slots included
    rng = np.random.default_rng(0)
    variables = [cudist.Variable(rng.standard_normal(n, dtype=np.float32), name=f"v{i}") for i in range(nvars)]
    grads = [np.full(n, 1e-3, np.float32) for _ in range(nvars)]
    opt = make()

    def step() -> None:
        opt.apply_gradients(zip(grads, variables))

    step()  # creates the slots
    ckpt = train.Checkpoint(optimizer=opt, variables=variables)
    asynchronous = train.CheckpointOptions(enable_async=True)
    if every is not None:
        _loop_mode(mib, name, nvars, rounds, every, saves or 3, ckpt, step, asynchronous, ab)
        return
    keys = ("sync save", "async call", "steps extra", "sync wait", "steps plain", "copy", "held call", "held extra",
            "cpu extra", "held cpu extra")
    t: dict[str, list[float]] = {k: [] for k in keys}
    write = _format.write_checkpoint
    gate = threading.Event()

    def held_write(*args: object, **kwargs: object) -> None:
        gate.wait(600)
        write(*args, **kwargs)  # type: ignore[arg-type]

    def save_then_steps() -> tuple[float, float, float]:
        """An asynchronous save, then ``steps`` steps: the call's time, the steps' time, and the
        process CPU time when it began."""
        a, cpu = time.perf_counter(), time.process_time()
        manager.save(options=asynchronous)
        b = time.perf_counter()
        for _ in range(steps):
            step()
        return b - a, time.perf_counter() - b, cpu

    with tempfile.TemporaryDirectory() as d:
        manager = train.CheckpointManager(ckpt, d, max_to_keep=2)
        manager.save()  # warm: the files exist, the page cache is in its steady state
        manager.save(options=asynchronous)  # warm: the buffers later saves recycle are faulted in
        for _ in range(steps):
            step()
        manager.sync()
        for _ in range(rounds):
            a, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            plain, plain_cpu = time.perf_counter() - a, time.process_time() - cpu
            t["steps plain"].append(plain)

            a = time.perf_counter()
            manager.save()
            t["sync save"].append(time.perf_counter() - a)

            call, stepped, cpu = save_then_steps()
            c = time.perf_counter()
            manager.sync()
            t["sync wait"].append(time.perf_counter() - c)
            t["cpu extra"].append(time.process_time() - cpu - plain_cpu)  # every thread's: the write's
            t["async call"].append(call)
            t["steps extra"].append(stepped - plain)

            gate.clear()
            _format.write_checkpoint = held_write
            try:
                call, stepped, cpu = save_then_steps()
                t["held cpu extra"].append(time.process_time() - cpu - plain_cpu)
            finally:
                _format.write_checkpoint = write
                gate.set()
            manager.sync()
            t["held call"].append(call)
            t["held extra"].append(stepped - plain)

            src = [v.numpy() for v in variables]
            a = time.perf_counter()
            for s in src:
                for _ in range(1 + nslots):  # the variable and its slots
                    s.copy()
            t["copy"].append(time.perf_counter() - a)
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    extra = med["steps extra"]
    blocked = med["async call"] + max(0.0, extra) + med["sync wait"]
    capture = med["held call"] + max(0.0, med["held extra"])
    print(f"{mib} MiB of variables + {name} slots ({nvars} variables), {rounds} rounds, {steps} steps after each "
          "async save; medians in ms")
    sync = med["sync save"]
    print("| sync save | async save call | steps after it, beyond plain | wait at sync() | blocked in all | "
          f"capture alone: call + steps beyond plain | {steps} plain steps | copy of the bytes | process CPU beyond plain: "
          "with the write, capture alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {sync:.1f} | {med['async call']:.2f} ({100 * med['async call'] / sync:.1f}%) | "
          f"{extra:.1f} | {med['sync wait']:.1f} | {blocked:.1f} ({100 * blocked / sync:.1f}%) | "
          f"{med['held call']:.2f} + {med['held extra']:.1f} = {capture:.1f} ({100 * capture / sync:.1f}%) | "
          f"{med['steps plain']:.1f} | {med['copy']:.1f} | {med['cpu extra']:.1f}, {med['held cpu extra']:.1f} |")


def _loop_mode(
    mib: int,
    name: str,
    nvars: int,
    rounds: int,
    every: int,
    saves: int,
    ckpt: train.Checkpoint,
    step: Callable[[], None],
    asynchronous: train.CheckpointOptions,
    ab: bool = False,
) -> None:
    """The ``--every`` mode: a save every ``every`` steps, the loop timed without saves, with sync and async ones
    (``ab``: each through the native and the Python tensor writer, and a plain copy of the bytes beside the loop)."""
    write = _format.write_checkpoint
    writes: list[float] = []

    write_cpu: list[float] = []  # thread CPU of each asynchronous checkpoint write (the writer thread's)
    spin_cpu: list[float] = []  # ... of the writes the spin imitates (async: the default, buffered writer)

    def timed(work: Callable[..., None]) -> Callable[..., None]:
        """``work`` recording its wall time in ``writes`` and, off the main thread (a background
        write, the copy, the spin), its thread's CPU time in ``write_cpu``."""

        def run_timed(*args: Any, **kwargs: Any) -> None:
            a, cpu = time.perf_counter(), time.thread_time()
            work(*args, **kwargs)
            writes.append(time.perf_counter() - a)
            if threading.current_thread() is not threading.main_thread():
                write_cpu.append(time.thread_time() - cpu)

        return run_timed

    timed_write = timed(write)

    default_nice = _settings.checkpoint_writer_nice()
    env = os.environ.get(_settings.CHECKPOINT_WRITER_NICE)
    other_nice = 10 if default_nice == 0 else 0
    native_writer = _format._write_crc32
    direct_env = os.environ.get(_settings.CHECKPOINT_DIRECT_IO)
    if ab:
        if native_writer is None:
            raise SystemExit("--ab needs cudist._core.write_crc32 (the extension built, PCLMULQDQ)")
        ways: tuple[str, ...] = ("plain", "sync", "sync direct", "sync python", "async", "async direct",
                                 "async python", "memcpy", "spin")
        # The copy's buffers: the checkpoint's size, faulted in once (as the page cache's pages are recycled).
        n = (mib << 20) // 8 // 4
        src = [np.random.default_rng(i).standard_normal(n, dtype=np.float32) for i in range(8)]
        dst = [np.ones_like(x) for x in src]
        spin, ns_per_iter = _spinner()
    else:
        ways = ("plain", "sync", f"async nice {default_nice}", f"async nice {other_nice}")
    loop: dict[str, list[float]] = {w: [] for w in ways}
    save_call: dict[str, list[float]] = {w: [] for w in ways}
    write_time: dict[str, list[float]] = {w: [] for w in ways if w != "plain" and not w.startswith("sync")}
    cpu_of: dict[str, list[float]] = {w: [] for w in write_time}  # the writer thread's CPU, per write
    with tempfile.TemporaryDirectory() as d:
        manager = train.CheckpointManager(ckpt, d, max_to_keep=2)

        @timed
        def copy_all() -> None:
            for x, y in zip(src, dst, strict=True):
                np.copyto(y, x)

        @timed
        def spin_write_cpu() -> None:
            spin(int(statistics.median(spin_cpu or [0.1]) * 1e9 / ns_per_iter))

        def run(way: str) -> None:
            options = None if way.startswith("sync") else asynchronous
            if way == f"async nice {other_nice}":
                os.environ[_settings.CHECKPOINT_WRITER_NICE] = str(other_nice)
            calls = 0.0
            del writes[:]
            del write_cpu[:]
            _format.write_checkpoint = timed_write
            _format._write_crc32 = None if way.endswith("python") else native_writer
            os.environ[_settings.CHECKPOINT_DIRECT_IO] = "on" if way.endswith("direct") else "off"
            copier: threading.Thread | None = None
            try:
                a = time.perf_counter()
                for _ in range(saves):
                    if way in ("memcpy", "spin"):
                        b = time.perf_counter()
                        if copier is not None:
                            copier.join()
                        target = {"memcpy": copy_all, "spin": spin_write_cpu}[way]
                        copier = threading.Thread(target=target)
                        copier.start()
                        calls += time.perf_counter() - b
                    elif way != "plain":
                        b = time.perf_counter()
                        manager.save(options=options)
                        calls += time.perf_counter() - b
                    for _ in range(every):
                        step()
                if copier is not None:
                    copier.join()
                manager.sync()
                loop[way].append(time.perf_counter() - a)
            finally:
                _format.write_checkpoint = write
                _format._write_crc32 = native_writer
                _set_env(_settings.CHECKPOINT_DIRECT_IO, direct_env)
                _set_env(_settings.CHECKPOINT_WRITER_NICE, env)
            save_call[way].append(calls / saves)
            if way in write_time:
                write_time[way].append(statistics.median(writes))
                if write_cpu:
                    cpu_of[way].append(statistics.median(write_cpu))
                if way == "async":
                    spin_cpu.extend(write_cpu)

        for way in ways:  # warm: files, page cache, the recycled buffers
            run(way)
        for w in ways:
            loop[w].clear()
            save_call[w].clear()
        for w in write_time:
            write_time[w].clear()
            cpu_of[w].clear()
        for r in range(rounds):
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
                run(way)
    plain = loop["plain"]
    per_save = {w: statistics.median([(x - p) / saves for x, p in zip(loop[w], plain, strict=True)]) * 1e3 for w in ways}
    sync_call = statistics.median(save_call["sync"]) * 1e3
    print(f"{mib} MiB of variables + {name} slots ({nvars} variables), {rounds} rounds of {saves} x (save, {every} steps) "
          "per way, order rotating; medians in ms")
    print(f"loop without saves: {statistics.median(plain) * 1e3:.1f} ms ({statistics.median(plain) * 1e3 / (saves * every):.2f} ms a step); "
          f"sync save call: {sync_call:.1f} ms; loop time per sync save beyond plain: {per_save['sync']:.1f} ms")
    if ab:
        for w in ("sync direct", "sync python"):
            call = statistics.median(save_call[w]) * 1e3
            print(f"{w} save call: {call:.1f} ms (sync / it: {sync_call / call:.3f}); loop time per save beyond plain: "
                  f"{per_save[w]:.1f} ms")
        print("writers: sync, async: native write_crc32 through the page cache (the default); direct: O_DIRECT "
              f"({'native' if _format._direct else 'unavailable: buffered'}); python: os.write + CRC-32 per MiB; "
              f"uptime load now: {os.getloadavg()[0]:.2f}")
    print("| writer | async save call | loop time per save beyond plain | blocked / sync save call | "
          "blocked / sync loop extra | background write, call to commit | its thread's CPU |")
    print("|---|---|---|---|---|---|---|")
    for w in [w for w in ways if w in write_time]:
        call = statistics.median(save_call[w]) * 1e3
        print(f"| {w} | {call:.2f} | {per_save[w]:.1f} | {100 * per_save[w] / sync_call:.1f}% | "
              f"{100 * per_save[w] / per_save['sync']:.1f}% | {statistics.median(write_time[w]) * 1e3:.0f} | "
              f"{statistics.median(cpu_of[w]) * 1e3 if cpu_of[w] else float('nan'):.0f} |")


def _set_env(name: str, value: str | None) -> None:
    """Sets environment variable ``name`` to ``value``, or removes it for None."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _spinner() -> tuple[Callable[[int], int], float]:
    """A Numba loop that burns CPU without the GIL or memory traffic (xorshift), and its ns per iteration."""
    import numba  # noqa: PLC0415 - only the --ab mode needs it

    @numba.njit(nogil=True)
    def spin(n: int) -> int:
        x = np.uint64(88172645463325252)
        for _ in range(n):
            x ^= x << np.uint64(13)
            x ^= x >> np.uint64(7)
            x ^= x << np.uint64(17)
        return int(x & np.uint64(1))

    spin(10)
    a = time.thread_time()
    spin(50_000_000)
    return spin, (time.thread_time() - a) * 1e9 / 50_000_000


if __name__ == "__main__":
    main()
