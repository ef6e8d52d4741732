"""One thread for a process's tensor work, when that work cannot stay on the main thread.

torch's CPU kernels run their parallel regions on GNU OpenMP (libgomp), which keeps a pool of helper
threads for every thread that has entered a parallel region, for as long as that thread lives. When
the pools together hold more threads than the machine has cores, libgomp stops busy-waiting between
regions (its "throttled" spin count, ~100 spins) and parks the helpers, so that each small kernel
of a decoding step then pays a futex wake-up. A service that loads its model on the main thread and
runs the steps on a worker thread ends up in exactly that state. Measured on a 2-core Intel Xeon
(torch 2.13, 2 threads, session 43): a [1, 576] x [576, 1536] linear 33 us on the first thread
that used OpenMP, 122-138 us on either thread once a second one had; the verify service's
1-position bf16 SmolLM2-135M step 48-50 ms against 29 ms, and a single client's tokens/s 20 -> 34
once the model was loaded on the thread that runs the steps.

So a process that needs a worker thread for its model (the verify service, the client daemon)
creates it with `compute_thread`, loads its models with it (`executor.submit(load).result()`), and
keeps every tensor operation large enough to be parallel (the model's, feature quantization) on it.
Threads that exit release their pools: short-lived helpers are harmless.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def compute_thread(name: str) -> ThreadPoolExecutor:
    """A single-thread executor (threads named `name`_0) to load and run a process's models on."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


def loaded_on_compute_thread(name: str, load: Callable[..., T], *args) -> tuple[ThreadPoolExecutor, T]:
    """A new `compute_thread(name)` and what `load(*args)` returned when run on it; the caller owns
    the executor and runs every later model step there. Raises what `load` raised (the thread is
    shut down first)."""
    worker = compute_thread(name)
    try:
        return worker, worker.submit(load, *args).result()
    except BaseException:
        worker.shutdown(wait=False)
        raise
