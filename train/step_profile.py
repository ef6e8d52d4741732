"""Where a training step's time goes, written by the run itself (`splitspec train --profile-steps N`).

A lent GPU is held for minutes, so the run that trains there is also the one that must say why its
steps take as long as they do: kernel launches (MoA's LSA once ran in tens of thousands of small
passes a step), host-device synchronisations, or the matmuls themselves. With N > 0 the trainer
runs `torch.profiler` over its steps 2 .. N + 1 of this invocation (the first step is skipped: it
pays allocator growth and kernel selection once) and writes `profile.txt` in the run folder:
wall time per profiled step, operator calls per step (nested calls counted), on a GPU the host's
waits for the device per step (CUDA runtime synchronisations: `.item()`, boolean-mask indexing and
copies from pageable memory each cost one, and a host that waits cannot queue the next kernels),
and the operators by self time (CUDA time on a GPU, CPU time otherwise). The cost is those N steps running a little slower.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

SKIPPED = 1  # leading steps not profiled
ROWS = 40  # operators listed


def host_waits(events, steps: int) -> str:
    """The CUDA runtime's synchronising calls in profiler `events`, per step: "total (name count,
    ...)". One cudaDeviceSynchronize a step is the profiler's own (`StepProfiler._sync`)."""
    waits = {e.key: e.count / max(1, steps) for e in events
             if e.key.startswith("cuda") and ("Synchronize" in e.key or e.key in ("cudaMemcpy", "cudaMemcpy2D"))}
    parts = ", ".join(f"{k} {v:g}" for k, v in sorted(waits.items(), key=lambda kv: -kv[1]))
    return f"{sum(waits.values()):g}" + (f" ({parts})" if parts else "")


class StepProfiler:
    """`step()` after every training step; profiles steps SKIPPED + 1 .. SKIPPED + `steps` and
    then writes `path`. A no-op once done."""

    def __init__(self, steps: int, device: str, path: Path, header: str = "") -> None:
        if steps < 1:
            raise ValueError(f"profile steps must be >= 1, got {steps}")
        self.steps, self.path, self.header = steps, Path(path), header
        self.cuda = torch.device(device).type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=SKIPPED, active=steps, repeat=1),
                             on_trace_ready=self._write)
        self._seen = 0
        self._step_s: list[float] = []
        self._last = time.perf_counter()
        self.done = False
        self._prof.start()

    def step(self) -> None:
        if self.done:
            return
        self._sync()
        now = time.perf_counter()
        if self._seen >= SKIPPED:
            self._step_s.append(now - self._last)
        self._seen += 1
        self._prof.step()
        self._last = time.perf_counter()
        if self._seen >= SKIPPED + self.steps:
            self.close()

    def close(self) -> None:
        """Stop profiling (early when the run ends first; then nothing may be written)."""
        if not self.done:
            self.done = True
            self._prof.stop()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _write(self, prof) -> None:
        events = prof.key_averages()
        ops = sum(e.count for e in events if not e.key.startswith("ProfilerStep"))
        n = max(1, len(self._step_s))
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        walls = ", ".join(f"{s:.3f}" for s in self._step_s)
        lines = [self.header, f"profiled steps: {len(self._step_s)}; wall s per step: {walls}; "
                              f"operators per step: {ops / n:.0f} (nested calls counted)", ""]
        if self.cuda:
            lines.append(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
            lines.append(f"host waits for the device per step: {host_waits(events, n)}\n")
        lines.append(f"by {sort}:")
        lines.append(events.table(sort_by=sort, row_limit=ROWS))
        if self.cuda:
            lines.append("by self_cpu_time_total:")
            lines.append(events.table(sort_by="self_cpu_time_total", row_limit=ROWS))
        self.path.write_text("\n".join(lines) + "\n")
