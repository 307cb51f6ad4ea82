"""autoshard.mpi vs mpi4py (and mpi4jax when installed); run with `make bench-mpi` (mpirun -np 2).

Settings: (a) one op per jitted call, (b) many ops in one jitted fori_loop (per-op cost).
Writes benchmarks/results/mpi.json and mpi.md. mpi4jax is measured when importable: `make
bench-mpi` installs it (CPU extension only, see mk/mpi.mk), and its column is skipped with the
reason otherwise.

At 4 MiB and more, the loop is also timed with huge pages switched off for its buffers
(AUTOSHARD_MPI_HUGE_PAGES=0's switch, set around those calls only): the cost of the 4 KiB
pages XLA allocates, against the huge pages NumPy's arrays (so mpi4py's buffers) get.

The machine is small and shared, so the competitors are interleaved: each round times every
competitor once, back to back (same conditions for all), in an order that is reversed every
other round (no competitor always follows the same one). The ratios to mpi4py are taken per
round and reported as their median with the quartiles; times as the median over rounds, the
minimum, and the spread (max - min) / median. Each sample is the maximum over ranks. XLA runs
single-threaded (one core per rank), like mpi4py.
"""

# ruff: noqa: B023  -- the timed lambdas run within their own loop iteration

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    " intra_op_parallelism_threads=1"
).strip()

import ctypes  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from autoshard import mpi  # noqa: E402
from autoshard.mpi._native import lib  # noqa: E402

try:
    import mpi4jax
except Exception as err:  # noqa: BLE001 -- not installed, or built against another jax/MPI
    mpi4jax, MPI4JAX_MISSING = None, f"{type(err).__name__}: {err}".splitlines()[0]
else:
    MPI4JAX_MISSING = None

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIZES = [int(s) for s in os.environ.get("BENCH_SIZES", "").split(",") if s] or [
    8,
    1024,
    1 << 20,
    16 << 20,
    64 << 20,
]
# Per size class: (ops per sample, ops in one jitted loop; a loop sample runs the loop
# ops per sample / loop ops times). Every competitor's sample runs the same number of ops: on
# a shared, oversubscribed machine a longer sample is preempted more often.
SAMPLE_OPS = {
    0: (400, 200),
    1 << 20: (400, 200),
    4 << 20: (64, 32),
    16 << 20: (32, 16),
    64 << 20: (16, 8),
}
HUGE_MIN = 4 << 20  # buffers from this size are put on huge pages (PreferHugePages, _ffi.cc)
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "15"))
OUT = pathlib.Path(__file__).parent / "results"


def sample(fn, repeats, per_call):
    """One timed block: ``repeats`` calls of ``fn``, in us per op (max over ranks)."""
    COMM.Barrier()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = (time.perf_counter() - t) / (repeats * per_call)
    return COMM.allreduce(elapsed, MPI.MAX) * 1e6


def measure(competitors, repeats):
    """Interleaved rounds, in us per op: ({name: {"median", "min", "spread"}}, {name: samples})."""
    for fn, _ in competitors.values():
        fn()  # compile and warm up
        fn()
    samples = {name: [] for name in competitors}
    order = list(competitors)
    for i in range(ROUNDS):
        for name in order if i % 2 == 0 else order[::-1]:
            fn, per_call = competitors[name]
            samples[name].append(sample(fn, max(repeats // per_call, 2), per_call))
    stats = {}
    for name, values in samples.items():
        median = statistics.median(values)
        stats[name] = {
            "median": median,
            "min": min(values),
            "spread": (max(values) - min(values)) / median,
        }
    return stats, samples


def paired_ratio(samples, name):
    """``name``'s time over mpi4py's, per round: {"median", "q1", "q3", "max", "over"}.

    Competitors of one round run back to back, so a round's ratio sees one load; the median of
    these ratios is steadier on a shared machine than the ratio of the medians. ``over`` counts
    the rounds above the 1.05x target.
    """
    ratios = [t / r for t, r in zip(samples[name], samples["mpi4py"], strict=True)]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "max": max(ratios),
        "over": sum(r > 1.05 for r in ratios),
    }


def _view(array, n):
    """A writable NumPy view of a CPU jax.Array's float32 buffer (no copy)."""
    address = array.unsafe_buffer_pointer()
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(address))


def _result(out):
    """mpi4jax before 0.8 returns (result, token), later versions the result alone."""
    return out[0] if isinstance(out, tuple) else out


def ops():
    """Per op: our call, its loop body over the carry (a, b), the mpi4jax body, mpi4py's call.

    The loop carries a send buffer and a receive buffer, as mpi4py reuses its two buffers;
    sendrecv receives into b in place, the others work on a in place.
    """
    peer = (RANK + 1) % SIZE
    m4j = mpi4jax
    return {
        "allreduce": (
            lambda v: mpi.allreduce(v, MPI.SUM)[0],
            lambda c: (mpi.allreduce(c[0], MPI.SUM)[0], c[1]),
            m4j and (lambda c: (_result(m4j.allreduce(c[0], MPI.SUM)), c[1])),
            lambda a, b: COMM.Allreduce(a, b, MPI.SUM),
        ),
        "bcast": (
            lambda v: mpi.bcast(v, 0)[0],
            lambda c: (mpi.bcast(c[0], 0)[0], c[1]),
            m4j and (lambda c: (_result(m4j.bcast(c[0], 0)), c[1])),
            lambda a, b: COMM.Bcast(a, 0),
        ),
        "sendrecv": (
            lambda v: mpi.sendrecv(v, v, peer, peer)[0],
            lambda c: (c[0], mpi.sendrecv(c[0], c[1], peer, peer)[0]),
            m4j and (lambda c: (c[0], _result(m4j.sendrecv(c[0], c[1], peer, peer)))),
            lambda a, b: COMM.Sendrecv(a, peer, 0, b, peer, 0),
        ),
    }


def main():
    results = []
    noop = jax.jit(lambda v: v + 0)
    for nbytes in SIZES:
        n = max(nbytes // 4, 1)
        x = jnp.ones(n, jnp.float32)
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        repeats, loop_n = SAMPLE_OPS[max(k for k in SAMPLE_OPS if k <= nbytes)]
        for name, (ours, body, m4j_body, ref) in ops().items():
            single = jax.jit(ours)

            def make_loop(body, k=loop_n):
                # The loop carries its state across calls (donated), as a solver would; mpi4py
                # likewise reuses its buffers.
                loop = jax.jit(
                    lambda c: jax.lax.fori_loop(0, k, lambda i, c: body(c), c), donate_argnums=0
                )
                state = [(jnp.ones(n, jnp.float32), jnp.ones(n, jnp.float32))]

                def run_loop():
                    state[0] = jax.block_until_ready(loop(state[0]))

                def buffers():
                    """NumPy views of the carry's memory (XLA's buffers, reused every call)."""
                    return [_view(v, n) for v in state[0]]

                run_loop.buffers = buffers
                return run_loop

            def ref_loop(k=loop_n, buffers=lambda: (a, b)):
                bufs = buffers()
                for _ in range(k):
                    ref(*bufs)

            ours_loop = make_loop(body)

            competitors = {
                "mpi4py": (ref_loop, loop_n),
                "jit_noop": (lambda: noop(x).block_until_ready(), 1),
                "autoshard_call": (lambda: single(x).block_until_ready(), 1),
                "autoshard_loop": (ours_loop, loop_n),
                "mpi4py_xla": (lambda: ref_loop(buffers=ours_loop.buffers), loop_n),
            }
            if nbytes >= HUGE_MIN:
                small_pages = make_loop(body)  # its own buffers, never advised

                def run_small_pages(run=small_pages):
                    lib.autoshard_mpi_set_huge_pages(0)
                    try:
                        run()
                    finally:
                        lib.autoshard_mpi_set_huge_pages(1)

                competitors["autoshard_loop_4k"] = (run_small_pages, loop_n)
            if m4j_body is not None:
                competitors["mpi4jax_loop"] = (make_loop(m4j_body), loop_n)
            stats, samples = measure(competitors, repeats)
            row = {
                "op": name,
                "bytes": nbytes,
                "loop_ops": loop_n,
                **{f"{k}_{s}": v for k, st in stats.items() for s, v in st.items()},
            }
            ref_us = row["mpi4py_median"]
            row["loop_ratio"] = row["autoshard_loop_median"] / ref_us
            row["loop_ratio_paired"] = paired_ratio(samples, "autoshard_loop")
            row["samples"] = {k: [round(v, 2) for v in vs] for k, vs in samples.items()}
            row["loop_ratio_min"] = row["autoshard_loop_min"] / row["mpi4py_min"]
            row["loop_excess_us"] = row["autoshard_loop_median"] - ref_us
            row["call_ratio"] = row["autoshard_call_median"] / (row["jit_noop_median"] + ref_us)
            row["mpi4py_xla_ratio"] = paired_ratio(samples, "mpi4py_xla")
            if m4j_body is not None:
                row["mpi4jax_loop_ratio"] = paired_ratio(samples, "mpi4jax_loop")
            if nbytes >= HUGE_MIN:
                row["loop_4k_ratio"] = paired_ratio(samples, "autoshard_loop_4k")
            results.append(row)
            if RANK == 0:
                extra = "".join(
                    f", {k} {_ratio(row[k])}"
                    for k in ("mpi4py_xla_ratio", "loop_4k_ratio", "mpi4jax_loop_ratio")
                    if k in row
                )
                print(
                    f"{name} {nbytes} B: mpi4py {row['mpi4py_median']:.1f} us, loop "
                    f"{row['autoshard_loop_median']:.1f} us, loop/mpi4py per round "
                    f"{_ratio(row['loop_ratio_paired'])}{extra}",
                    flush=True,
                )
    if RANK == 0:
        write(results)


def _ratio(p):
    return f"{p['median']:.2f} [{p['q1']:.2f}-{p['q3']:.2f}]"


def write(results):
    OUT.mkdir(exist_ok=True)
    meta = {
        "ranks": SIZE,
        "jax": jax.__version__,
        "mpi": MPI.Get_library_version().split(",")[0],
        "mpi4jax": getattr(mpi4jax, "__version__", None),
        "mpi4jax_missing": MPI4JAX_MISSING,
        "sample_ops": {str(k): v for k, v in SAMPLE_OPS.items()},
        "rounds": ROUNDS,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    (OUT / "mpi.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    m4j = meta["mpi4jax"] or f"skipped ({MPI4JAX_MISSING})"
    lines = [
        "# autoshard.mpi benchmark",
        "",
        f"{SIZE} ranks on {meta['cpus']} CPUs (load average at the end "
        f"{meta['load_average'][0]:.1f}, shared machine), {meta['mpi']}, jax {meta['jax']}, "
        f"mpi4jax: {m4j}. XLA single-threaded. Times in microseconds per op: median over "
        f"{ROUNDS} interleaved rounds (each sample the max over ranks), with the minimum and the "
        "spread (max - min) / median.",
        "",
        "- mpi4py: a Python loop of calls on NumPy buffers, as many ops per sample as the "
        "loop's.",
        "- loop: per-op time inside one jitted fori_loop (200 ops; 32 from 4 MiB, 16 from "
        "16 MiB, 8 at 64 MiB; "
        "each sample runs the loop twice, as many ops as every other competitor's sample) "
        "whose carry is donated and fed back, call "
        "after call (steady state, no input copy); target <= mpi4py + 1 us at 8 B and <= 1.05x "
        "mpi4py from 1 MiB.",
        "- 4 KiB pages: the same loop with huge pages switched off for its buffers. XLA "
        "allocates on 4 KiB pages, NumPy asks for transparent huge pages from 4 MiB, and MPI's "
        "shared-memory transfers of large messages are slower over small pages; autoshard.mpi "
        "therefore advises its buffers of 4 MiB and more onto huge pages, with the two 2 MiB "
        "pages their ends fall in where one mapping holds them whole (AUTOSHARD_MPI_HUGE_PAGES"
        "=0 opts out).",
        "- call: one op per jitted call; target <= 2x (jitted no-op + mpi4py).",
        "- The loop carries a send and a receive buffer, like mpi4py's two buffers: sendrecv "
        "receives into the second in place, allreduce and bcast work on the first in place (no "
        "copy per op; the compiled loop has no copy of either buffer).",
        "- mpi4jax: the same loop with mpi4jax's operations (registry version), when installed.",
        "- mpi4py on XLA's buffers: mpi4py's calls on the loop's own carry (the same memory "
        "as our operations use): what MPI itself costs on that memory, apart from our call.",
        "- Per round: the round's time over mpi4py's in the same round (the competitors of a "
        "round run back to back, under one load; the order is reversed every other round), "
        "as the median over rounds [first - third quartile]; `> 1.05x` counts the rounds "
        "above the target. loop/mpi4py (medians) divides the medians instead.",
        "",
        "Target rows (bcast and sendrecv from 1 MiB, loop/mpi4py per round, median "
        "[quartiles]):",
        "",
    ]
    for r in results:
        if r["op"] in ("bcast", "sendrecv") and r["bytes"] >= 1 << 20:
            p = r["loop_ratio_paired"]
            verdict = "met" if p["median"] <= 1.05 else "missed"
            lines.append(
                f"- {r['op']} {r['bytes'] >> 20} MiB: {_ratio(p)}, {p['over']} of {ROUNDS} "
                f"rounds above 1.05x: {verdict}"
            )
    lines += [
        "",
        "| op | bytes | mpi4py | loop (min, spread) | loop/mpi4py per round | > 1.05x | "
        "loop/mpi4py (medians) | loop - mpi4py | mpi4py on XLA's buffers/mpi4py per round | "
        "4 KiB pages loop/mpi4py per round | "
        "mpi4jax loop/mpi4py per round | call | no-op jit | call/(no-op+mpi4py) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ref = r["mpi4py_median"]
        m4j = _ratio(r["mpi4jax_loop_ratio"]) if "mpi4jax_loop_ratio" in r else "-"
        small = _ratio(r["loop_4k_ratio"]) if "loop_4k_ratio" in r else "-"
        lines.append(
            f"| {r['op']} | {r['bytes']} | {ref:.1f} | {r['autoshard_loop_median']:.1f} "
            f"({r['autoshard_loop_min']:.1f}, {r['autoshard_loop_spread']:.0%}) | "
            f"{_ratio(r['loop_ratio_paired'])} | {r['loop_ratio_paired']['over']} | "
            f"{r['loop_ratio']:.2f} | {r['loop_excess_us']:+.1f} | "
            f"{_ratio(r['mpi4py_xla_ratio'])} | {small} | {m4j} | "
            f"{r['autoshard_call_median']:.1f} | "
            f"{r['jit_noop_median']:.1f} | {r['call_ratio']:.2f} |"
        )
    (OUT / "mpi.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
