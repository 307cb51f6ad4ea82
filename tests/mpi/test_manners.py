"""Importing autoshard.mpi changes nothing else; its hooks are narrow and opt-in; debug logging.

Each test runs a fresh interpreter (a single-rank MPI job of its own), so that the import
really is the first one.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="runs its own single-rank interpreter (runs once)")

UNRELATED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax._src import util
    from jax._src.interpreters import mlir as private_mlir, partial_eval as pe
    from jax.sharding import NamedSharding, PartitionSpec as P

    def programs():
        x = jnp.arange(8.0)
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
        xs = jax.device_put(x, NamedSharding(mesh, P("d")))

        def unused_control_flow(v):
            jax.lax.cond(v[0] > 0, lambda u: u + 1, lambda u: u, v)  # unused: removed
            jax.lax.fori_loop(0, 3, lambda i, c: c * 2, v)
            jax.jit(lambda u: u - 1)(v)
            return v.sum()

        fns = [
            (lambda v: jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c), v), x),
            (lambda v: jax.lax.cond(v[0] > 0, jnp.cos, jnp.sin, v), x),
            (lambda v: jax.lax.scan(lambda c, y: (c + y, c * y), 0.0, v), x),
            (lambda v: jax.jit(lambda u: u * 2)(v) + 1, x),
            (jax.grad(lambda v: jnp.sum(jnp.tanh(v) ** 2)), x),
            (unused_control_flow, x),
            (lambda v: v * 2 + 1, xs),
            (jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"),
                           out_specs=P()), xs),
        ]
        return [jax.jit(f).lower(a).as_text() for f, a in fns]

    def state():
        return (sys.excepthook, util.test_event_listener, private_mlir.lower_jaxpr_to_module,
                dict(pe.dce_rules))
""")

CHECK_IMPORT = UNRELATED + textwrap.dedent("""
    hook = lambda *a: sys.__excepthook__(*a)
    sys.excepthook = hook
    before, state_before = programs(), state()
    from mpi4py import MPI
    from autoshard import mpi
    after, state_after = programs(), state()
    assert state_after[0] is hook, "sys.excepthook changed by the import"
    assert state_after[1] is None, "a lowering listener left set by the import"
    assert state_after[2] is state_before[2], "lower_jaxpr_to_module replaced"
    # New entries are the MPI primitives' own rules; JAX's are untouched.
    assert all(state_after[3][k] is rule for k, rule in state_before[3].items()), "DCE rules changed"
    assert after == before, "unrelated programs lower differently after the import"

    # Use MPI (inside control flow and a nested jit): the lowering hook is gone afterwards
    # and unrelated programs still lower byte for byte as before.
    def f(v):
        jax.lax.cond(v[0] > 0, lambda u: (mpi.barrier(), u)[1], lambda u: u, v)
        return jax.jit(lambda u: mpi.allreduce(u, MPI.SUM)[0])(v)
    text = jax.jit(f).lower(jnp.ones(2)).as_text()
    assert "autoshard_mpi_barrier" in text and " call @" not in text
    assert float(jax.jit(f)(jnp.ones(2))[0]) == 1.0
    assert util.test_event_listener is None
    assert programs() == before, "unrelated programs lower differently after MPI was used"
    assert sys.excepthook is hook
    print("OK")
""")

CHAINED_LISTENER = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax._src import util
    from mpi4py import MPI
    from autoshard import mpi
    events = []
    listener = lambda name, *args: events.append(name)
    util.test_event_listener = listener
    f = lambda v: jax.jit(lambda u: mpi.allreduce(u, MPI.SUM)[0])(v) + 1
    text = jax.jit(f).lower(jnp.ones(2)).as_text()
    assert " call @" not in text, "the MPI module was not finished (nested jit not inlined)"
    assert util.test_event_listener is listener, "the user's listener was not restored"
    assert "mlir.collect_lowered_jaxprs" in events and "lower_jaxpr_to_module" in events
    print("OK")
""")

ABORT_OPT_IN = textwrap.dedent("""
    import sys
    seen = []
    sys.excepthook = lambda kind, value, tb: seen.append(str(value))
    import os
    os.environ["AUTOSHARD_MPI_ABORT"] = "1"
    from autoshard import mpi
    assert sys.excepthook is not None and getattr(sys.excepthook, "autoshard_mpi", False)
    hook = sys.excepthook
    mpi.abort_on_uncaught_exception()  # idempotent
    assert sys.excepthook is hook
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)  # one rank: no abort
    assert seen == ["boom"], seen
    print("OK")
""")

DEBUG = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from mpi4py import MPI
    from autoshard import mpi
    jax.block_until_ready(jax.jit(lambda v: mpi.allreduce(v, MPI.SUM)[0])(jnp.ones(4)))
    mpi.barrier()
    print("OK")
""")


def _run(code, **env):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))},
           "JAX_PLATFORMS": "cpu", **env}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
    return proc


def test_import_patches_nothing_and_lowering_is_byte_identical():
    _run(CHECK_IMPORT)


def test_lowering_hook_chains_to_existing_listener():
    _run(CHAINED_LISTENER)


def test_abort_on_uncaught_exception_is_opt_in_and_chained():
    _run(ABORT_OPT_IN)


def test_debug_logging():
    proc = _run(DEBUG, AUTOSHARD_MPI_DEBUG="1")
    lines = proc.stderr.splitlines()
    assert "r0 | allreduce 16 B (comm 1, device 0) ..." in lines, proc.stderr
    assert any(line.startswith("r0 | allreduce 16 B done in ") and line.endswith(" us")
               for line in lines), proc.stderr
    assert any(line.startswith("r0 | barrier 0 B done in ") for line in lines), proc.stderr
    quiet = _run(DEBUG)
    assert "r0 |" not in quiet.stderr


def test_debug_flag_validated():
    code = "import autoshard.mpi"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))},
           "AUTOSHARD_MPI_DEBUG": "verbose"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode != 0
    assert "AUTOSHARD_MPI_DEBUG ('verbose') must be 1 or 0" in proc.stderr
