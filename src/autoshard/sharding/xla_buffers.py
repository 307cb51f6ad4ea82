"""What XLA's CPU backend writes to memory beyond the step's own values, by the rules read
from its buffer assignment and live ranges: the layout copies of matrix product and
convolution operands, the broadcasts a reduction's kernel writes out in full, and the point
from which XLA may compute such a copy (mesh independent, memoised per graph). The memory
model (``memory``) adds them to the values it keeps live.
"""

from __future__ import annotations

import numpy as np

from .fusion import BITCASTS, taken_products
from .problem import Problem
from .spec import shards
from .strategy import itemsize, nbytes


def unbitcast(g, u):
    """The value whose buffer ``u`` is (through reshapes, which move no data)."""
    while u is not None and g.nodes[g.values[u].producer].kind in BITCASTS:
        u = g.nodes[g.values[u].producer].operands[0]
    return u


def broadcast_dims(g, u: int, out: int) -> list[int]:
    """Dims of value ``out`` along which operand ``u`` of an element-wise op is repeated."""
    shape, full = tuple(g.values[u].shape), tuple(g.values[out].shape)
    shape = (1,) * (len(full) - len(shape)) + shape
    return [d for d, (a, b) in enumerate(zip(shape, full, strict=True)) if a == 1 and b > 1]


def broadcast_buffers(prob: Problem) -> list[tuple[int, int, int, list[int]]]:
    """The repeated operands XLA writes out in full for a reduction's kernel: (first node,
    last node, variable, bytes per strategy).

    The kernel that takes a reduction's multiply (``fusion.taken_products``) repeats an
    operand along the reduced dims itself, but one repeated along a kept dim (a norm's
    scale in ``sum(g * x_hat * scale, -1)``, its per-row ``rsqrt`` in the scale gradient
    ``sum(g * x_hat, (0, 1))``) is a broadcast XLA writes to memory at the product's size.
    It depends only on the small operand, so XLA makes it as soon as that exists (the
    scale's: at the step's first reads, the ``rsqrt``'s: in the forward pass) and holds it
    until the backward's reduction: read from XLA's live ranges of the families ViT, two
    per LayerNorm."""
    g, mesh = prob.graph, prob.ctx.mesh_shape
    taken = g.memoised("taken_products", lambda: taken_products(g, prob.free))
    ready = ready_points(g)
    found = []
    for reduce_id, mul_id in taken.items():
        axes = set(g.nodes[reduce_id].params.get("axes", ()))
        mul = g.nodes[mul_id]
        out = g.values[mul.outputs[0]]
        size = itemsize(out.dtype) * int(np.prod(out.shape, dtype=np.int64))
        for u in mul.operands:
            if u is None or g.values[u].producer in prob.free:
                continue
            dims = broadcast_dims(g, u, out.id)
            if not dims or all(d in axes for d in dims):
                continue
            root = unbitcast(g, u)
            first = ready.get(root, g.values[root].producer)
            found.append((min(first, mul_id), reduce_id, prob.var(mul_id),
                          [size // shards(st.out_specs[0], mesh)
                           for st in prob.strategies[mul_id]]))
    return found


SCATTER_KINDS = frozenset({"scatter-add", "scatter_add", "scatter"})


def early_scatter_targets(prob: Problem) -> list[tuple[int, int, int, list[int]]]:
    """The buffers XLA makes for a gather's gradient before the backward pass: (first node,
    last node, variable, bytes per strategy).

    A gather's transpose scatters the cotangent into zeros at the gather's indices (a
    cross-entropy's integer labels, an embedding's tokens). XLA does not wait for the
    cotangent: what depends only on the indices (the mask of where they point, the zero
    target) is computed where the indices are ready, in the forward pass, and held at the
    scatter's size until the scatter (read from XLA's live ranges of the families decoder at
    its test size: the labels' 256 KB mask and the embedding gradient's 64 KB target per
    device, made in the forward pass). From the indices' ready point to the point before the
    zero target, which the estimate holds from there as a value."""
    g, mesh = prob.graph, prob.ctx.mesh_shape
    ready = ready_points(g)
    found = []
    for node in g.nodes:
        if node.kind not in SCATTER_KINDS or len(node.operands) < 2:
            continue
        target, indices = node.operands[0], node.operands[1]
        if target is None or indices is None:
            continue
        made = g.nodes[g.values[target].producer]
        if made.kind != "broadcast_in_dim" or any(u is not None for u in made.operands):
            continue   # a target computed by the program (not a constant) is a value
        first = ready.get(indices, g.values[indices].producer)
        if first >= made.id:
            continue
        size = nbytes(g.values[node.outputs[0]])
        found.append((first, made.id - 1, prob.var(node.id),
                      [size // shards(st.out_specs[0], mesh) for st in prob.strategies[node.id]]))
    return found


WORKSPACE_KINDS = {"conv_general_dilated"}
"""Ops whose backends copy operands into their own layout (see ``copied_operands``)."""


def copied_operands(node) -> list[int]:
    """Operand positions of a convolution that XLA copies into another layout first.

    XLA's CPU convolution wants the image batch-major and feature-minor (NHWC) and the kernel
    output-feature-minor (HWIO). The convolutions JAX's autodiff makes are not in that form:
    the weight gradient reads the forward image with its features as the batch (and the
    output gradient as the kernel), the input gradient reads the kernel with its features
    swapped. Each such operand gets a transposed copy.
    """
    dn = node.params.get("dimension_numbers")
    if dn is None:
        return [0]
    rank = len(dn.lhs_spec)
    natural_lhs = (0, rank - 1) + tuple(range(1, rank - 1))
    natural_rhs = (rank - 1, rank - 2) + tuple(range(rank - 2))
    out = []
    if tuple(dn.lhs_spec) != natural_lhs:
        out.append(0)
    if tuple(dn.rhs_spec) != natural_rhs:
        out.append(1)
    return out


def dot_layout_copies(g) -> list[tuple[int, int]]:
    """(dot node, operand position) of every matrix product operand that is a step input
    XLA's CPU copies into another layout first (mesh independent).

    XLA's CPU matrix product reads each operand as (batch dims, rows, contracting dims) for
    the left and (batch dims, contracting dims, columns) for the right, each group in the
    order the dimension numbers give, or a plain matrix transposed (two dims, no batch).
    Any other order is a transposed copy: the input-gradient products of a multi-head
    projection read its kernel (dim, heads, head_dim) with the heads and head_dim
    contracted. Read from XLA's buffer assignment of the families ViT: the copies of the
    q, k, v and o kernels are made at the step's first reads and held until the backward
    product (4 per block). Copies of computed values, made next to their product, are not
    counted."""
    memo = g.memo.get("dot_layout_copies")
    if memo is not None:
        return memo
    found = []
    for node in g.nodes:
        if node.kind != "dot_general":
            continue
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        for p, (contracting, batch) in enumerate(((lc, lb), (rc, rb))):
            u = node.operands[p] if p < len(node.operands) else None
            root = unbitcast(g, u)
            if root is None or g.nodes[g.values[root].producer].kind != "input":
                continue
            rank = len(node.in_avals[p].shape)
            rest = [d for d in range(rank) if d not in contracting and d not in batch]
            order = (list(batch) + rest + list(contracting) if p == 0
                     else list(batch) + list(contracting) + rest)
            if order != list(range(rank)) and not (rank == 2 and not batch):
                found.append((node.id, p))
    g.memo["dot_layout_copies"] = found
    return found


def ready_points(g) -> dict[int, int]:
    """Per value: the point from which XLA may compute a copy of it (its producer; a step
    input's first reader), which is where its scheduler puts the copy.

    A value computed from the step's donated state alone (``Graph.memo["aliases"]``: an Adam
    moment times its decay, read by an update that runs in another spec) is ready with the
    first input read: XLA's scheduler computes and gathers it there, before the forward
    pass, and holds the gathered copy until the update (read from XLA's live ranges of such
    a plan)."""
    memo = g.memo.get("ready_points")
    if memo is not None:
        return memo
    from_inputs = [False] * len(g.values)
    for i, _ in g.memo.get("aliases", ()):
        from_inputs[g.nodes[g.inputs[i]].outputs[0]] = True
    for node in g.nodes:
        if node.kind == "input":
            continue
        elif node.kind not in LOOP_NODE_KINDS and node.operands and all(
                u is None or from_inputs[u] for u in node.operands):
            for v in node.outputs:
                from_inputs[v] = True
    ready, start = {}, None
    for node in g.nodes:
        for u in node.operands:
            if u is not None and u not in ready:
                p = g.values[u].producer
                if g.nodes[p].kind == "input":
                    ready[u] = node.id
                    start = node.id if start is None else start
                else:
                    ready[u] = min(p, start) if from_inputs[u] and start is not None else p
    g.memo["ready_points"] = ready
    return ready


LOOP_NODE_KINDS = frozenset({"carry", "carry_back", "xs", "ys", "cond_out"})
"""The graph's loop nodes: a value they make is the loop's, not one XLA computes up front."""


__all__ = ["LOOP_NODE_KINDS", "SCATTER_KINDS", "WORKSPACE_KINDS", "broadcast_buffers",
           "broadcast_dims", "copied_operands", "dot_layout_copies", "early_scatter_targets",
           "ready_points", "unbitcast"]
