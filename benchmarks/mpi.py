"""autoshard.mpi vs mpi4py (and mpi4jax when installed); run with `make bench-mpi` (mpirun -np 2).

Settings: (a) one op per jitted call, (b) 200 ops in one jitted fori_loop (per-op cost).
Writes benchmarks/results/mpi.json and mpi.md.
"""

# ruff: noqa: B023  -- the timed lambdas run within their own loop iteration

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from autoshard import mpi

try:
    import mpi4jax
except ImportError:
    mpi4jax = None

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIZES = [8, 1024, 1 << 20, 16 << 20, 64 << 20]
LOOP = 200
OUT = pathlib.Path(__file__).parent / "results"


def timeit(fn, repeats):
    fn()
    COMM.Barrier()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats)
    return COMM.allreduce(best, MPI.MAX) * 1e6  # us


def ops(x):
    peer = (RANK + 1) % SIZE
    return {
        "allreduce": (lambda v: mpi.allreduce(v, MPI.SUM)[0],
                      lambda a, b: COMM.Allreduce(a, b, MPI.SUM)),
        "bcast": (lambda v: mpi.bcast(v, 0)[0], lambda a, b: COMM.Bcast(a, 0)),
        "sendrecv": (lambda v: mpi.sendrecv(v, v, peer, peer)[0],
                     lambda a, b: COMM.Sendrecv(a, peer, 0, b, peer, 0)),
    }


def main():
    results = []
    noop = jax.jit(lambda v: v)
    for nbytes in SIZES:
        n = max(nbytes // 4, 1)
        x = jnp.ones(n, jnp.float32)
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        repeats = 2000 if nbytes < 1 << 20 else (50 if nbytes < 16 << 20 else 5)
        loop_n = LOOP if nbytes < 16 << 20 else 10
        t_noop = timeit(lambda: noop(x).block_until_ready(), repeats)
        for name, (ours, ref) in ops(x).items():
            single = jax.jit(ours)
            loop = jax.jit(lambda v, f=ours, k=loop_n: jax.lax.fori_loop(0, k, lambda i, c: f(c), v))
            row = {
                "op": name, "bytes": nbytes, "jit_noop_us": t_noop,
                "mpi4py_us": timeit(lambda: ref(a, b), repeats),
                "autoshard_call_us": timeit(lambda: single(x).block_until_ready(), repeats),
                "autoshard_loop_us": timeit(lambda: loop(x).block_until_ready(),
                                            max(repeats // loop_n, 2)) / loop_n,
            }
            if mpi4jax is not None and name == "allreduce":
                m4j = jax.jit(lambda v: mpi4jax.allreduce(v, MPI.SUM)[0])
                row["mpi4jax_call_us"] = timeit(lambda: m4j(x).block_until_ready(), repeats)
            row["loop_ratio"] = row["autoshard_loop_us"] / row["mpi4py_us"]
            row["call_ratio"] = row["autoshard_call_us"] / (row["jit_noop_us"] + row["mpi4py_us"])
            results.append(row)
            if RANK == 0:
                print(json.dumps(row), flush=True)
    if RANK == 0:
        OUT.mkdir(exist_ok=True)
        meta = {"ranks": SIZE, "jax": jax.__version__, "mpi": MPI.Get_library_version().split(",")[0],
                "mpi4jax": getattr(mpi4jax, "__version__", None), "loop_ops": LOOP}
        (OUT / "mpi.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        lines = [
            "# autoshard.mpi benchmark", "",
            f"{SIZE} ranks, {meta['mpi']}, jax {meta['jax']}, mpi4jax: {meta['mpi4jax'] or 'not installed'}. "
            "Times in microseconds (max over ranks, best of 3).", "",
            "- loop: per-op time inside one jitted fori_loop (200 ops; 10 at >= 16 MiB); target <= mpi4py + 1 us "
            "at 8 B and <= 1.05x mpi4py from 1 MiB.",
            "- call: one op per jitted call; target <= 2x (jitted no-op + mpi4py).", "",
            "| op | bytes | mpi4py | loop | loop/mpi4py | call | no-op jit | call/(no-op+mpi4py) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in results:
            lines.append(f"| {r['op']} | {r['bytes']} | {r['mpi4py_us']:.1f} | {r['autoshard_loop_us']:.1f} | "
                         f"{r['loop_ratio']:.2f} | {r['autoshard_call_us']:.1f} | {r['jit_noop_us']:.1f} | "
                         f"{r['call_ratio']:.2f} |")
        (OUT / "mpi.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
