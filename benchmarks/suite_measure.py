"""Measures of a compiled step: step times, collective bytes from HLO, memory per device."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from autoshard.sharding import hlo

COLLECTIVES = hlo.KINDS


def collective_bytes(hlo_text: str | list[str], num_devices: int
                     ) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
    """Per collective kind: result bytes one device receives per step, executions per step, and
    bytes one device sends per step (``wire_bytes``: ring algorithms over each group's size).

    Read by ``autoshard.sharding.hlo``, the audit's reader: loop bodies count their trips. On
    the CPU XLA lowers a reduce-scatter to an all-reduce and a slice, so it counts as one.
    A list holds one module per compiled task (a pipeline), each read on its own: modules
    joined into one text would share computation names.
    """
    num_bytes = dict.fromkeys(COLLECTIVES, 0)
    counts = dict.fromkeys(COLLECTIVES, 0)
    wire = dict.fromkeys(COLLECTIVES, 0.0)
    texts = [hlo_text] if isinstance(hlo_text, str) else hlo_text
    for c in (c for t in texts for c in hlo.collectives(t, (), (num_devices,))):
        num_bytes[c.kind] += c.num_bytes * c.count
        counts[c.kind] += c.count
        wire[c.kind] += c.wire_bytes * c.count
    return num_bytes, counts, wire


def memory_per_device(compiled) -> dict[str, int | None]:
    """Bytes per device from XLA's memory analysis of the compiled step."""
    try:
        m = compiled.memory_analysis()
    except Exception:        # some backends have no memory analysis
        return {"peak_bytes_per_device": None, "xla_peak_memory_bytes": None}
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)
    peak = getattr(m, "peak_memory_in_bytes", 0) or None
    return {"peak_bytes_per_device": int(total), "xla_peak_memory_bytes": peak,
            "argument_bytes": int(m.argument_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes)}


class Stepper:
    """Steps one (model, plan) pair, carrying its donated train state from step to step."""

    def __init__(self, step, state, batch):
        self.step, self.state, self.batch = step, state, batch
        self.times: list[float] = []
        self.losses: list[float] = []
        self.error: str | None = None

    def __call__(self, timed: bool) -> None:
        t0 = time.perf_counter()
        self.state, loss = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, loss))
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.losses.append(float(loss))


def time_interleaved(steppers: dict, *, warmup: int, repeats: int, budget_s: float,
                     min_rounds: int = 2) -> None:
    """Warm every stepper up, then time them round-robin, one step each per round.

    Interleaving spreads background load (other processes on shared cores) over all plans
    instead of penalising whichever ran while it lasted. Runs at least ``min_rounds`` and at
    most ``repeats`` rounds, and starts no new round after ``min_rounds`` once ``budget_s``
    seconds of timed stepping are spent. A stepper that raises records its error and leaves
    the rotation.
    """
    def run(name, stepper, timed):
        try:
            stepper(timed)
        except Exception as e:       # recorded by the caller
            stepper.error = f"{type(e).__name__}: {e}"[-2000:]

    for name, stepper in steppers.items():
        for _ in range(warmup):
            if stepper.error is None:
                run(name, stepper, timed=False)
    t0 = time.perf_counter()
    names = list(steppers)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            if steppers[name].error is None:
                run(name, steppers[name], timed=True)
        if r + 1 >= min_rounds and time.perf_counter() - t0 > budget_s:
            break


def summarize_times(times: list[float]) -> dict[str, float]:
    """Median, spread (interquartile range, min, max) of step times in seconds."""
    q = np.percentile(times, [25, 75]) if len(times) > 1 else (times[0], times[0])
    return {"step_time_s": statistics.median(times), "step_time_iqr_s": float(q[1] - q[0]),
            "step_time_min_s": min(times), "step_time_max_s": max(times),
            "num_timed_steps": len(times)}
