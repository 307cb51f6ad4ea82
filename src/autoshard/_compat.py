"""Every JAX-version workaround lives here and nowhere else (tested range: jax 0.10.x)."""

from __future__ import annotations

import jax
import jax.extend.core
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, Mesh

# Internal-but-stable registries used to define primitives (public aliases in jax 0.10).
primitive_jvps = ad.primitive_jvps
primitive_transposes = ad.primitive_transposes
primitive_batchers = batching.primitive_batchers
register_lowering = mlir.register_lowering
Zero = ad.Zero
is_undefined_primal = ad.is_undefined_primal
instantiate_zeros = ad.instantiate_zeros

Primitive = jax.extend.core.Primitive
ClosedJaxpr = jax.extend.core.ClosedJaxpr
Jaxpr = jax.extend.core.Jaxpr
JaxprEqn = jax.extend.core.JaxprEqn
Var = jax.extend.core.Var
Literal = jax.extend.core.Literal
DropVar = jax.extend.core.DropVar


def make_auto_mesh(device_array, axis_names) -> Mesh:
    """A Mesh whose axes are all ``AxisType.Auto`` (the XLA partitioner propagates shardings)."""
    names = tuple(axis_names)
    return Mesh(device_array, names, axis_types=(AxisType.Auto,) * len(names))


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def bind_eqn(eqn, invals):
    """Re-bind one jaxpr equation on concrete or traced values (as jax.core.eval_jaxpr does)."""
    params = eqn.primitive.get_bind_params(eqn.params)  # jax 0.10: params only, no subfuns
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]
