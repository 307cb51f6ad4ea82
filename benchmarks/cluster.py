"""Plan for a cluster you do not have: the Megatron-LM paper's GPT rows on described A100s.

Source of every paper figure (model shapes, GPUs, global batch, tensor x pipeline split,
TFLOP/s per GPU): Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21, arXiv 2104.04473), Table 1 (weak scaling; GPT, seq 2048,
vocab 51200, DGX A100 80GB nodes: 8 GPUs on NVLink, 8x200 Gb/s InfiniBand between nodes;
splits chosen by hand). These are not the Alpa paper's (OSDI'22) GPT rows: Alpa benchmarks
GPT-3 125M-76B at seq 1024 on 1-64 GPUs (alpa-projects/alpa,
benchmark/alpa/paper_manual_gpt_suite.py, ``gpt_specs``). ``ROWS`` keeps the Megatron-LM
paper's figures; ``SOURCE`` is printed with the results.

Each row is planned by ``autoshard.plan`` for ``Cluster.a100_80gb(num_hosts)`` on abstract
shapes (nothing is allocated, no GPU is used), with the planner choosing the mesh:

* the model: pre-LN GPT, fused QKV, bf16 compute on fp32 master weights, Adam (fp32 moments),
  every layer rematerialised (``jax.checkpoint``), layers as a ``lax.scan`` over stacked
  weights (``--unroll``: a Python loop of layers instead), the paper's global batch as one step;
* ``plan_s``: wall time of ``autoshard.plan`` (trace + plan) on this machine; the 18.4B
  unrolled row is planned a second time with every mesh solved (no LP-bound cutoff, no
  best-first order), the baseline of the same run;
* split: ``data`` = pieces the batch dim of the layer activations is cut into, ``tensor`` =
  devices / data; ``zero`` marks weights also split over a data axis (gathered at use);
* the paper's plan priced by the same model: ``autoshard.plan`` with a
  ``ManualShardingOption`` holding Megatron's specs (batch over ``data``; QKV and the first
  MLP matrix split by columns, the attention output and second MLP matrix by rows, the
  embedding by vocabulary over ``model``; Adam moments as their weights) on the paper's
  (data, tensor) mesh, the step's activations pinned to Megatron's layout
  (``megatron_pin``: ``with_sharding_constraint`` on an ``AbstractMesh``); the planner
  places only what is left unpinned;
* TFLOP/s per GPU = the program's matrix-product FLOPs as traced (JAX's recompute included)
  / estimated step time / devices; "eq. 3" TFLOP/s count the step as the paper does
  (``Objective.model_flops``: 3 x the forward + the forward every remat recomputes, equal to
  the paper's eq. 3 for this GPT; the traced count reads 7-8% under it because JAX does not
  recompute each layer's last matmul). Published Table 1 figures are eq. 3's.

Run: ``python benchmarks/cluster.py [--rows 1.7B 3.6B] [--unroll]``; writes
``benchmarks/results/cluster.{json,md}`` (``--rewrite``: only the markdown from the json;
``--out DIR``: another results directory; ``--before OLD.json``: keep the rows of an earlier
run in the json and tabulate what moved, row by row).
The 39.1B row (tensor 8 x pipeline 2 on 512 GPUs) is planned without a pipeline (scan rows);
``--pipeline`` plans it with ``PipeshardParallel`` as well (``run_pipeline``): the step
unrolled with a ``mark_pipeline_boundary()`` every 6 layers (8 pipeline layers), 16
micro-batches, 1F1B; the stage search (``AutoStageOption`` over sub-meshes of 16, 32 and 64
hosts, layer times planned per layer) beside the paper's stages priced the same way
(``ManualStageOption``: 2 stages of 4 pipeline layers, each on 32 hosts as a (32, 8) mesh,
the arrays inside each stage placed by the planner). Each result's ``explain()`` is kept in
the json.

``--auto ROWS``: the rows planned by ``AutoParallel`` (``cluster_auto.{json,md}``), each
pipeline row with ``link_bytes`` of its choice and of the paper's split (the bytes each GPU
sends per step over NVLink and through its NIC, by what sends them); ``--auto-merge
OTHER.json``: another run's rows in place of those of the same model, the md rewritten with
its hand-written sections kept.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard import (
    AutoShardingOption,
    AutoStageOption,
    Cluster,
    ManualShardingOption,
    ManualStageOption,
    PipeshardParallel,
    ShardParallel,
)
from autoshard.sharding import solver
from autoshard.sharding.cost import VOLUME, CostModel, axis_devices_per_host
from autoshard.sharding.graph import build_graph
from autoshard.sharding.plan import spec_axes

VOCAB, SEQ = 51200, 2048
RESULTS = Path(__file__).parent / "results"
"""Where the results go (``--out`` replaces it)."""
SOURCE = ("Narayanan et al., SC'21, arXiv 2104.04473, Table 1: model shapes, GPUs, global "
          "batch, tensor x pipeline split and achieved TFLOP/s per GPU (aggregate = TFLOP/s x "
          "GPUs: 4.4, 8.8, 18.2, 34.6, 70.8 PFLOP/s). Checked against public copies: the "
          "heads, hidden size and layers of all five rows match two Megatron-LM configuration "
          "tables found by code search; no copy of the table's TFLOP/s column was found, so "
          "those stay as transcribed from the paper (the 18.4B row reads 135, 43% of peak: "
          "the issue's '137-142' range is loose). The Alpa paper (OSDI'22) has other GPT rows "
          "(seq 1024, 125M-76B on 1-64 GPUs: alpa-projects/alpa, "
          "benchmark/alpa/paper_manual_gpt_suite.py) and is not the source of these")
# name: hidden, heads, layers, GPUs, global batch, paper (tensor, pipeline), paper TFLOP/s per GPU
ROWS = {
    "1.7B": (2304, 24, 24, 32, 512, (1, 1), 137),
    "3.6B": (3072, 32, 30, 64, 512, (2, 1), 138),
    "7.5B": (4096, 32, 36, 128, 512, (4, 1), 142),
    "18.4B": (6144, 48, 40, 256, 1024, (8, 1), 135),
    "39.1B": (8192, 64, 48, 512, 1536, (8, 2), 138),
}
AUTO_ROWS = {
    **ROWS,
    "76.1B": (10240, 80, 60, 1024, 1792, (8, 4), 140),
    "145.6B": (12288, 96, 80, 1536, 2304, (8, 8), 148),
    "310.1B": (16384, 128, 96, 1920, 2160, (8, 16), 155),
    "529.6B": (20480, 128, 105, 2520, 2520, (8, 35), 163),
    "1T": (25600, 160, 128, 3072, 3072, (8, 64), 163),
    "GPT-3 175B": (12288, 96, 96, 1024, 1536, None, None),
}
"""Rows ``--auto`` plans with ``AutoParallel``: Table 1's (rows 6-10 as the paper lists
them) and GPT-3 175B on 1,024 GPUs (issue 24's extra row; no split or TFLOP/s published for
it at that size)."""
AUTO_TIME_LIMIT_S = 300
"""A row whose planning takes longer is stopped; its time is recorded instead."""
PIPELINE_ROWS = {"39.1B"}
PIPELINE_LAYERS = 8
"""Pipeline layers the 48 transformer layers are grouped into (a boundary every 6)."""
PIPELINE_MICRO_BATCHES = 16
"""Micro-batches per step for the pipelined row (our choice: Table 1 gives no micro-batch
size; 1536 / 16 = 96 sequences per micro-batch, 3 per data-parallel replica of 32)."""
BASELINE_ROWS = {"18.4B"}
"""Rows also planned without the solver's cutoff (unrolled only): the speed baseline."""
BF16 = jnp.bfloat16
TX = optax.adam(1e-4)
DROPOUT = 0.0
"""Dropout rate of the GPT (``--dropout``; Megatron-LM's runs use 0.1 on the attention
probabilities and on each sub-layer's output, its defaults ``--attention-dropout`` and
``--hidden-dropout``). At 0 the step takes no random key."""


def dropout(x, key):
    """Inverted dropout at ``DROPOUT`` (a Bernoulli keep mask, kept values scaled up)."""
    keep = jax.random.bernoulli(key, 1.0 - DROPOUT, x.shape)
    return jnp.where(keep, x / (1.0 - DROPOUT), jnp.zeros_like(x)).astype(x.dtype)


def layer_norm(x, scale):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale).astype(BF16)


def no_pin(x, *spec):
    return x


def block(x, p, pin=no_pin, key=None):
    """One pre-LN layer; ``pin`` places the activations (Megatron's plan), or nothing;
    ``key``: the layer's dropout key (None: no dropout)."""
    drop = (lambda v, i: dropout(v, jax.random.fold_in(key, i))) if key is not None else (
        lambda v, i: v)
    p = jax.tree.map(lambda a: a.astype(BF16), p)
    x = pin(x, "data", None, None)
    qkv = pin(jnp.einsum("bsd,dthk->tbshk", layer_norm(x, p["ln1"]), p["wqkv"]),
              None, "data", None, "model", None)
    q, k, v = qkv[0], qkv[1], qkv[2]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    n = x.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e4)
    probs = pin(drop(jax.nn.softmax(s.astype(jnp.float32), -1).astype(BF16), 0),
                "data", "model", None, None)
    heads = pin(jnp.einsum("bhqs,bshk->bqhk", probs, v), "data", None, "model", None)
    x = pin(x + drop(jnp.einsum("bqhk,hkd->bqd", heads, p["wo"]), 1), "data", None, None)
    hidden = pin(jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["w1"]), "data", None, "model")
    return pin(x + drop(hidden @ p["w2"], 2), "data", None, None)


def megatron_pin(mesh: AbstractMesh):
    """Megatron-LM's activation layout on ``mesh``: batch over data, heads/hidden over model."""
    def pin(x, *spec):
        spec = [a if a in mesh.axis_names else None for a in spec]
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))
    return pin


def make_step(scan: bool, pin=no_pin, layers_per_boundary: int | None = None):
    """The GPT step: layers as a ``lax.scan`` or unrolled. With ``layers_per_boundary`` the
    unrolled layers get a pipeline boundary that often, and the gradient is
    ``autoshard.value_and_grad`` (its loss marker splits forward from backward)."""
    remat_block = jax.checkpoint(lambda x, p, key: block(x, p, pin, key))
    grad = autoshard.value_and_grad if layers_per_boundary else jax.value_and_grad

    def loss_fn(params, tokens, targets, rng=None):
        embed = params["embed"].astype(BF16)
        x = embed[tokens]
        n = len(params["layers"]) if isinstance(params["layers"], list) else (
            params["layers"]["w1"].shape[0])
        keys = [None] * n if rng is None else jax.random.split(rng, n + 1)
        if rng is not None:
            x = dropout(x, keys[-1])
        if scan:
            x, _ = jax.lax.scan(lambda c, pk: (remat_block(c, *pk), None), x,
                                (params["layers"], None if rng is None else keys[:n]))
        else:
            for i, p in enumerate(params["layers"]):
                if layers_per_boundary and i and i % layers_per_boundary == 0:
                    autoshard.mark_pipeline_boundary()
                x = remat_block(x, p, keys[i])
        logits = pin((layer_norm(x, params["ln_f"]) @ embed.T).astype(jnp.float32),
                     "data", None, "model")
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    def train_step(state, tokens, targets, *rng):
        params, opt = state
        loss, grads = grad(loss_fn)(params, tokens, targets, *rng)
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    return train_step


def abstract_args(hidden, heads, layers, batch, scan):
    def f(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def layer(lead=()):
        return {"ln1": f(*lead, hidden), "ln2": f(*lead, hidden),
                "wqkv": f(*lead, hidden, 3, heads, hidden // heads),
                "wo": f(*lead, heads, hidden // heads, hidden),
                "w1": f(*lead, hidden, 4 * hidden), "w2": f(*lead, 4 * hidden, hidden)}
    params = {"embed": f(VOCAB, hidden), "ln_f": f(hidden),
              "layers": layer((layers,)) if scan else [layer() for _ in range(layers)]}
    tokens = jax.ShapeDtypeStruct((batch, SEQ), jnp.int32)
    rng = (jax.ShapeDtypeStruct((2,), jnp.uint32),) if DROPOUT else ()  # a raw PRNG key
    return ((params, jax.eval_shape(TX.init, params)), tokens, tokens) + rng


def megatron_specs(args, tensor: int):
    """Megatron-LM's layout of the step's inputs: tensor split of each layer over ``model``."""
    m = "model" if tensor > 1 else None
    by_name = {"embed": P(m, None), "wqkv": P(None, None, m, None), "wo": P(m, None, None),
               "w1": P(None, m), "w2": P(m, None)}

    def spec(path, leaf):
        names = [k.key for k in path if isinstance(getattr(k, "key", None), str)]
        base = by_name.get(names[-1]) if names else None
        if base is None:
            return P()
        return P(*([None] * (len(leaf.shape) - len(base))), *base)  # stacked layers: dim 0

    state = jax.tree_util.tree_map_with_path(spec, args[0])
    return (state, P("data", None), P("data", None)) + (P(),) * (len(args) - 3)


def paper_flops(hidden, layers, batch) -> float:
    """The paper's FLOPs per step (its eq. 3, with activation recomputation)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden)
                                                    + VOCAB / (16 * layers * hidden))


def split_of(plan, step, args, batch, hidden) -> dict:
    """data x tensor of the plan: how the layer activations' batch dim is cut."""
    closed = jax.make_jaxpr(step)(*args)
    leaves = jax.tree.leaves(args)
    graph = build_graph(closed, [str(i) for i in range(len(leaves))],
                        [str(i) for i in range(len(closed.jaxpr.outvars))])
    sizes = plan.mesh_sizes
    # Intermediates are keyed by their site in the program (value ids in older plans).
    sites = getattr(graph, "sites", None) or {v: v for v in range(len(graph.values))}
    shape_of = {key: graph.values[v].shape for v, key in sites.items()}
    votes = collections.Counter()
    for key, spec in plan.intermediates:
        shape = shape_of[key]
        if len(shape) == 3 and shape[0] == batch and shape[2] == hidden:
            axes = spec[0] if len(spec) else None
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            votes[axes] += 1
    data_axes = votes.most_common(1)[0][0] if votes else ()
    data = int(np.prod([sizes[a] for a in data_axes])) if data_axes else 1
    zero = sorted({a for leaf in plan.inputs[:len(jax.tree.leaves(args[0]))] for e in leaf.spec
                   for a in ((e,) if isinstance(e, str) else (e or ())) if a in data_axes})
    return {"data": data, "tensor": int(np.prod(plan.mesh_shape)) // data,
            "data_axes": list(data_axes), "zero_axes": zero}


def run(name: str, scan: bool) -> dict:
    hidden, heads, layers, gpus, batch, (t, p), paper_tflops = ROWS[name]
    row = {"model": name, "hidden": hidden, "heads": heads, "layers": layers, "gpus": gpus,
           "batch": batch, "paper_tensor": t, "paper_pipeline": p, "paper_data": gpus // (t * p),
           "paper_tflops": paper_tflops, "layers_as": "scan" if scan else "unrolled",
           "dropout": DROPOUT}
    step = make_step(scan)
    args = abstract_args(hidden, heads, layers, batch, scan)
    cluster = Cluster.a100_80gb(gpus // 8)
    method = ShardParallel(auto_sharding_option=AutoShardingOption(show_progress=False))
    t0 = time.perf_counter()
    plan = autoshard.plan(step, *args, cluster=cluster, method=method, batch_argnums=(1, 2))
    row["plan_s"] = time.perf_counter() - t0
    row["load_average"] = os.getloadavg()[0]  # the machine is shared: how busy it was
    if name in BASELINE_ROWS and not scan:
        # The same plan without the LP-bound cutoff and best-first order (every mesh solved to
        # its optimum), timed in this run: the speed-up as a ratio on the same machine.
        keep, solver.CUTOFF_MIN_COLUMNS = solver.CUTOFF_MIN_COLUMNS, 1 << 62
        try:
            t0 = time.perf_counter()
            base = autoshard.plan(step, *args, cluster=cluster, method=method,
                                  batch_argnums=(1, 2))
            row["plan_s_without_cutoff"] = time.perf_counter() - t0
        finally:
            solver.CUTOFF_MIN_COLUMNS = keep
        row["same_plan_without_cutoff"] = (base.mesh_shape == plan.mesh_shape
                                           and base.objective.total_s == plan.objective.total_s)
    o = plan.objective
    row.update(mesh=list(plan.mesh_shape), **split_of(plan, step, args, batch, hidden),
               step_s=o.total_s, compute_s=o.compute_s,
               communication_s=o.communication_s + o.resharding_s,
               flops=o.flops, paper_formula_flops=paper_flops(hidden, layers, batch),
               tflops=o.flops / o.total_s / gpus / 1e12,
               model_flops=getattr(o, "model_flops", 0.0),
               eq3_tflops=paper_flops(hidden, layers, batch) / o.total_s / gpus / 1e12,
               memory_gib=o.peak_bytes_per_device / 2**30,
               sustained_flops=cluster.peak_flops * cluster.flops_efficiency,
               meshes_tried=[[list(s), v] for s, v in o.meshes_tried],
               meshes_pruned=[[list(s), why] for s, why in o.meshes_pruned],
               solver_status=o.solver_status, cluster=plan.cluster)
    if p > 1:  # the paper's plan is a pipeline: priced by run_pipeline (--pipeline)
        row["paper_unpriced"] = (
            f"the paper's plan (tensor {t} x pipeline {p}) is a pipeline: priced with "
            "PipeshardParallel in the pipeline table below (--pipeline); the planner's plan "
            "here is without a pipeline")
        return row
    # The paper's plan priced by the same model: Megatron's specs on the paper's mesh.
    names, shape = (("data", "model"), (gpus // t, t)) if t > 1 else (("data",), (gpus,))
    paper_method = ShardParallel(
        manual_sharding_option=ManualShardingOption(names, in_axis_resources=megatron_specs(
            args, t)),
        auto_sharding_option=AutoShardingOption(show_progress=False, logical_mesh_shape=shape))
    pinned = make_step(scan, megatron_pin(AbstractMesh(shape, names,
                                                       axis_types=(AxisType.Auto,) * len(shape))))
    t0 = time.perf_counter()
    paper = autoshard.plan(pinned, *args, cluster=cluster, batch_argnums=(1, 2),
                           method=paper_method).objective
    row.update(paper_price_s=time.perf_counter() - t0, paper_step_s=paper.total_s,
               paper_compute_s=paper.compute_s,
               paper_communication_s=paper.communication_s + paper.resharding_s,
               paper_est_tflops=paper.flops / paper.total_s / gpus / 1e12,
               paper_eq3_tflops=paper_flops(hidden, layers, batch) / paper.total_s / gpus / 1e12,
               paper_memory_gib=paper.peak_bytes_per_device / 2**30)
    return row


def stage_cluster(stage, cluster) -> Cluster:
    """The cluster of a priced stage's sub-mesh (its hosts x devices per host)."""
    hosts, dph = stage.physical_shape
    return dataclasses.replace(cluster, num_hosts=hosts, devices_per_host=dph)


def inter_host_dot_all_reduce_s(stage, cluster) -> float:
    """Seconds of a stage's backward plans spent in all-reduces of matrix-product results over
    mesh axes that cross hosts (with the batch split over those axes: the weight gradients'
    data-parallel reduction)."""
    sub = stage_cluster(stage, cluster)
    total = 0.0
    for name, plan in stage.plans:
        crosses = dict(zip(plan.axis_names, sub.axis_crosses_hosts(plan.mesh_shape),
                           strict=True))
        total += sum(c.cost_s for c in plan.collectives
                     if name.startswith("B") and c.kind == "all-reduce"
                     and c.where.startswith("dot_general") and any(crosses[a] for a in c.axes))
    return total


LINK_PARTS = ("tensor", "data", "reduce", "pipeline")
"""What ``link_bytes`` splits a GPU's traffic into: collectives of the tasks over the stage's
other axes (tensor-parallel), over its data axes (ZeRO gathers, reductions left in a task),
the stage's once-per-step gradient reduction, and the copies to other stages."""


def ring_phases(costs, sub, kind: str, axes: tuple[int, ...], num_bytes: float) -> list:
    """(axis, ring bytes one GPU sends, of them through its NIC) per phase of a collective
    on a sub-mesh's ``costs`` (``CostModel.collective_steps``); see ``link_bytes``."""
    shape = costs.mesh_shape
    crosses = sub.axis_crosses_hosts(shape)
    dph = sub.devices_per_host if sub.num_hosts > 1 else None
    out = []
    for a, size, _ in costs.collective_steps(kind, axes, num_bytes):
        sent = VOLUME[kind](shape[a]) * size
        out.append((a, sent, sent / axis_devices_per_host(shape, a, dph) if crosses[a]
                    else 0.0))
    return out


def link_bytes(est, cluster, rows: int) -> dict:
    """Bytes one GPU of each stage of ``est`` (a ``PipelineEstimate`` priced on ``cluster``)
    sends per step over NVLink and through its NIC, by ``LINK_PARTS``; ``rows``: rows of one
    micro-batch (a task input whose dim 0 has that size holds rows: the mesh axes splitting
    it are the stage's data axes).

    Each collective of a task plan is split into the cost model's phases
    (``CostModel.collective_steps``: one per axis, fastest link first); a phase over an axis
    of ``n`` devices moving ``b`` bytes sends ``VOLUME[kind](n) * b`` ring bytes per GPU (the
    bytes the model charges the link for); an axis crossing hosts with ``k`` of its devices
    in each host sends ``1/k`` of them through each GPU's NIC and the rest over NVLink
    (``cluster.md``'s rule). F and B tasks run once per micro-batch, apply tasks and the
    reduce (an all-reduce of ``reduce_bytes`` over the data axes) once per step. A copy to
    another stage (``send_bytes``: F outputs go to the next stage, B outputs to the one before,
    apply outputs to any other) goes through the NIC when the two stages span more than one
    host (as the pricing's ``_sends`` charges it).
    Seconds: ``model_s`` is what the pricing charges (collectives' ``cost_s``, ``reduce_s``,
    ``send_s``), ``nvlink_s`` / ``nic_s`` the bytes at the links' bandwidths alone."""
    k = est.num_micro_batches
    dph = cluster.devices_per_host
    hosts = [set(range(s.devices[0] // dph, (s.devices[0] + s.devices[1] - 1) // dph + 1))
             for s in est.stages]
    out = []
    for st in est.stages:
        sub = stage_cluster(st, cluster)
        shape = tuple(st.mesh_shape)
        costs = CostModel(shape, *sub.mesh_costs(shape))
        names = tuple(st.plans[0][1].axis_names)  # a stage's tasks share its mesh
        index = {a: i for i, a in enumerate(names)}
        data = {a for name, plan in st.plans if not name.startswith("apply")
                for leaf in plan.inputs if leaf.shape and leaf.shape[0] == rows and leaf.spec
                for a in spec_axes(leaf.spec[0])}
        parts = {p: {"nvlink_bytes": 0.0, "nic_bytes": 0.0, "model_s": 0.0}
                 for p in LINK_PARTS}

        def add(phases, part=None, *, names=names, data=data, parts=parts):
            for a, sent, nic in phases:
                into = parts[part or ("data" if names[a] in data else "tensor")]
                into["nic_bytes"] += nic
                into["nvlink_bytes"] += sent - nic

        for name, plan in st.plans:
            runs = 1 if name.startswith("apply") else k
            for c in plan.collectives:
                axes = tuple(index[x] for x in c.axes)
                add(ring_phases(costs, sub, c.kind, axes, c.num_bytes * c.count * runs))
                on_data = {names[a] in data for a in axes if shape[a] > 1}
                parts["data" if on_data == {True} else "tensor"]["model_s"] += c.cost_s * runs
        if st.reduce_bytes:
            add(ring_phases(costs, sub, "all-reduce", tuple(sorted(index[a] for a in data)),
                            st.reduce_bytes), "reduce")
            parts["reduce"]["model_s"] += st.reduce_s
        for kind, nbytes in st.send_bytes.items():
            runs = 1 if kind == "apply" else k
            to = ([st.stage + 1] if kind == "F" else [st.stage - 1] if kind.startswith("B")
                  else [s.stage for s in est.stages if s.stage != st.stage])
            to = [s for s in to if 0 <= s < len(est.stages)]
            link = "nic_bytes" if any(len(hosts[s] | hosts[st.stage]) > 1 for s in to) else (
                "nvlink_bytes")
            parts["pipeline"][link] += nbytes * runs
            parts["pipeline"]["model_s"] += st.send_s.get(kind, 0.0) * runs
        for p in parts.values():
            p["nvlink_s"] = p["nvlink_bytes"] / cluster.intra_host_bandwidth
            p["nic_s"] = p["nic_bytes"] / cluster.inter_host_bandwidth
        out.append({"stage": st.stage, "mesh": list(shape), "data_axes": sorted(data),
                    "parts": parts,
                    "nvlink_bytes": sum(p["nvlink_bytes"] for p in parts.values()),
                    "nic_bytes": sum(p["nic_bytes"] for p in parts.values())})
    return {"num_micro_batches": k, "stages": out}


def pipeline_summary(est, cluster, explain: bool = True) -> dict:
    """The fields of a priced pipeline kept in the results (``explain``: its ``explain()``
    too)."""
    return {"step_s": est.step_s, "makespan_s": est.makespan_s, "apply_s": est.apply_s,
            "bubble_fraction": est.bubble_fraction, "flops": est.flops,
            "tflops": est.tflops_per_device, "memory_gib": est.peak_bytes_per_device / 2**30,
            "stages": [{"layers": [s.layers[0], s.layers[-1]], "devices": list(s.devices),
                        "physical_shape": list(s.physical_shape),
                        "mesh": list(s.mesh_shape), "task_s": s.task_s, "send_s": s.send_s,
                        "backward_communication_s": sum(
                            p.objective.communication_s + p.objective.resharding_s
                            for name, p in s.plans if name.startswith("B")),
                        "backward_inter_host_dot_all_reduce_s": inter_host_dot_all_reduce_s(
                            s, cluster),
                        "reduce_bytes": s.reduce_bytes, "reduce_s": s.reduce_s,
                        "memory_gib": s.memory_bytes / 2**30} for s in est.stages]} | (
                {"explain": est.explain()} if explain else {})


def run_pipeline(name: str) -> dict:
    """The row planned with a pipeline: the stage search, and the paper's stages priced."""
    hidden, heads, layers, gpus, batch, (t, p), paper_tflops = ROWS[name]
    k, group = PIPELINE_MICRO_BATCHES, layers // PIPELINE_LAYERS
    row = {"model": name, "hidden": hidden, "heads": heads, "layers": layers, "gpus": gpus,
           "batch": batch, "paper_tensor": t, "paper_pipeline": p, "paper_data": gpus // (t * p),
           "paper_tflops": paper_tflops, "layers_as": "pipeline", "num_micro_batches": k,
           "pipeline_layers": PIPELINE_LAYERS}
    step = make_step(False, layers_per_boundary=group)
    args = abstract_args(hidden, heads, layers, batch, scan=False)
    hosts = gpus // 8
    cluster = Cluster.a100_80gb(hosts)
    quiet = AutoShardingOption(show_progress=False)
    # The paper's stages: p stages of layers / p layers, each on gpus / p GPUs as a
    # (data, tensor) = (hosts / p, 8) mesh; the planner places the arrays inside each stage.
    per = PIPELINE_LAYERS // p
    paper = PipeshardParallel(
        num_micro_batches=k, layer_option="manual", default_auto_sharding_option=quiet,
        stage_option=ManualStageOption(
            [list(range(i * per, (i + 1) * per)) for i in range(p)], [(hosts // p, 8)] * p,
            [(hosts // p, 8)] * p, [{}] * p))
    t0 = time.perf_counter()
    est = autoshard.plan(step, *args, cluster=cluster, method=paper, batch_argnums=(1, 2))
    row["paper_price_s"] = time.perf_counter() - t0
    row["paper_pipeline_priced"] = pipeline_summary(est, cluster)
    row["paper_pipeline_priced"]["eq3_tflops"] = paper_flops(hidden, layers, batch) / (
        est.step_s * gpus * 1e12)
    print(est.explain(), file=sys.stderr, flush=True)
    search = PipeshardParallel(
        num_micro_batches=k, layer_option="manual", default_auto_sharding_option=quiet,
        stage_option=AutoStageOption(
            submesh_physical_shape_space="manual", layer_profile_mode="individual",
            manually_specified_submeshes=[(h, 8) for h in (hosts // 4, hosts // 2, hosts)]))
    t0 = time.perf_counter()
    est = autoshard.plan(step, *args, cluster=cluster, method=search, batch_argnums=(1, 2))
    row["plan_s"] = time.perf_counter() - t0
    row["load_average"] = os.getloadavg()[0]
    row["planned_pipeline"] = pipeline_summary(est, cluster)
    row["planned_pipeline"]["eq3_tflops"] = paper_flops(hidden, layers, batch) / (
        est.step_s * gpus * 1e12)
    print(est.explain(), file=sys.stderr, flush=True)
    return row


def run_paper_pipeline(name: str) -> dict:
    """The paper's split of a Table 1 row priced as a pipeline (issue 26 item 8: pricing time).

    p stages of layers / p layers (the step unrolled with a boundary every layers / p
    layers), each on hosts / p whole hosts as a (hosts / p, 8) mesh (data over hosts, tensor
    8 in the node, as the paper's t = 8), one sequence per data replica per micro-batch
    (batch / d micro-batches: 96 to 512), 1F1B; the planner places the arrays inside each
    stage. Wall and CPU seconds of ``autoshard.plan``."""
    hidden, heads, layers, gpus, batch, (t, p), paper_tflops = AUTO_ROWS[name]
    hosts, d = gpus // 8, gpus // (t * p)
    k = batch // d
    row = {"model": name, "hidden": hidden, "heads": heads, "layers": layers, "gpus": gpus,
           "batch": batch, "paper_tensor": t, "paper_pipeline": p, "paper_data": d,
           "paper_tflops": paper_tflops, "num_micro_batches": k}
    step = make_step(False, layers_per_boundary=layers // p)
    args = abstract_args(hidden, heads, layers, batch, scan=False)
    method = PipeshardParallel(
        num_micro_batches=k, layer_option="manual",
        default_auto_sharding_option=AutoShardingOption(show_progress=False),
        stage_option=ManualStageOption(
            [[i] for i in range(p)], [(hosts // p, 8)] * p, [(hosts // p, 8)] * p, [{}] * p))
    cluster = Cluster.a100_80gb(hosts)
    t0, c0 = time.perf_counter(), time.process_time()
    est = autoshard.plan(step, *args, cluster=cluster, method=method, batch_argnums=(1, 2))
    row.update(price_s=time.perf_counter() - t0, price_cpu_s=time.process_time() - c0,
               load_average=os.getloadavg()[0], step_s=est.step_s,
               link_bytes=link_bytes(est, cluster, batch // k),
               pipeline=pipeline_summary(est, cluster, explain=False),
               eq3_tflops=paper_flops(hidden, layers, batch) / (est.step_s * gpus * 1e12),
               memory_gib=est.peak_bytes_per_device / 2**30,
               bubble_fraction=est.bubble_fraction)
    print(est.explain(), file=sys.stderr, flush=True)
    return row


def write_paper_pipelines(rows: list[dict]):
    """cluster_paper_pipelines.{json,md}: the paper's pipelines priced, and how long it took."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cluster_paper_pipelines.json").write_text(json.dumps({"rows": rows}, indent=1))
    lines = ["# The paper's pipelines priced (issue 26 item 8)", "",
             "`autoshard.plan(..., method=PipeshardParallel(stage_option=ManualStageOption(...)))`"
             " on `Cluster.a100_80gb(GPUs / 8)`: Table 1's (t, p, d) with t = 8 inside each "
             "node, p stages of layers / p layers on (hosts / p, 8) sub-meshes, one sequence "
             "per data replica per micro-batch, 1F1B, dropout "
             f"{rows[0].get('dropout', DROPOUT) if rows else DROPOUT}. {platform.machine()}, "
             f"{os.cpu_count()} CPUs shared with other jobs: wall seconds move with the load "
             "(given), CPU seconds of the pricing process do not. Target: < 60 s each.", "",
             "| model | GPUs | (t, p, d) | micro-batches | step s | eq. 3 TFLOP/s | paper | "
             "bubble | GiB | price s (wall) | CPU s | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['model']} | | | | {r.get('error', 'stopped')} | | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['gpus']} | ({r['paper_tensor']}, {r['paper_pipeline']}, "
            f"{r['paper_data']}) | {r['num_micro_batches']} | {r['step_s']:.2f} | "
            f"{r['eq3_tflops']:.0f} | {r['paper_tflops']} | {r['bubble_fraction']:.3f} | "
            f"{r['memory_gib']:.1f} | {r['price_s']:.0f} | {r['price_cpu_s']:.0f} | "
            f"{r['load_average']:.1f} |")
    (RESULTS / "cluster_paper_pipelines.md").write_text("\n".join(lines) + "\n")


def micro_batch_counts(batch: int, searched: int) -> list[int]:
    """The micro-batch counts ``--auto`` searches: the fewest from PIPELINE_MICRO_BATCHES up
    that divide the batch (529.6B's 2520 sequences: 18), then the fewest from 3x and 9x it up
    (``searched`` counts in all)."""
    def at_least(n):
        return next(d for d in range(n, batch + 1) if batch % d == 0)
    first = at_least(PIPELINE_MICRO_BATCHES)
    return sorted({at_least(first * 3**i) for i in range(searched)})


AUTO_ROW_SEARCH = {
    "529.6B": {"pipeline_layers": 35, "micro_batch_counts": (56, 280), "host_parts": (7, 21, 35)},
    "1T": {"pipeline_layers": 64, "micro_batch_counts": (128, 512), "host_parts": (16, 32, 64)},
    "310.1B": {"pipeline_layers": 16, "micro_batch_counts": (48, 144), "host_parts": (4, 8, 16)},
}
"""Rows whose search space is not the default one (8 pipeline layers, 16 micro-batches or the
next count dividing the batch, sub-meshes of hosts / 1, 2, 4, 8). 529.6B's 315 hosts are
3^2 x 5 x 7 and its hidden size 20480 = 2^12 x 5: a data axis of 3, 7 or 9 hosts shards no
weight and, with 18 micro-batches (140 sequences), no batch either, and sub-meshes of
315 / 1, 3, 5, 7 hosts make at most 7 stages of 15 layers; the planner's own error asks for
10 or more stages (session 21: no plan in 515 s). So: 35 pipeline layers of 3 transformer
layers, sub-meshes of 45, 15 and 9 hosts, and micro-batches of 45 and 9 sequences (56 and
280), which divide over those hosts' data axes. AutoParallel chooses among them. 1T
(384 hosts, 128 layers): 64 pipeline layers of 2, sub-meshes of 24, 12 and 6 hosts, and
micro-batches of 24 and 6 sequences (128, 512), which divide over all of them, as the paper's
(8, 64, 6) needs (the row in the default space stopped after 600 s in session 12). 310.1B
(240 hosts, 96 layers): the default space's 8 pipeline layers cap a pipeline at 8 stages, and
the paper's (8, 16, 15) has 16 of 15 hosts with 144 micro-batches of 15 sequences; so 16
pipeline layers of 6, sub-meshes of 60, 30 and 15 hosts, micro-batches of 45 and 15
sequences (48, 144)."""


def run_auto(name: str, pipeline_layers: int | None = None, searched: int = 1,
             host_parts: tuple[int, ...] | None = None) -> dict:
    """The row planned by ``AutoParallel``: the whole-mesh plan and pipelines of 2 or more
    stages (sub-meshes of all the hosts / ``host_parts``: whole hosts; layer times planned
    per pipeline layer; ``searched`` micro-batch counts), the fastest that fits chosen.
    Unset arguments take the row's ``AUTO_ROW_SEARCH`` entry, else the defaults; a row's
    micro-batch counts there replace ``searched``'s."""
    hidden, heads, layers, gpus, batch, split, paper_tflops = AUTO_ROWS[name]
    custom = AUTO_ROW_SEARCH.get(name, {})
    pipeline_layers = pipeline_layers or custom.get("pipeline_layers", PIPELINE_LAYERS)
    host_parts = host_parts or custom.get("host_parts", (1, 2, 4, 8))
    counts = list(custom.get("micro_batch_counts", ())) or micro_batch_counts(batch, searched)
    k = counts[0]
    group = -(-layers // pipeline_layers)
    hosts = gpus // 8
    row = {"model": name, "hidden": hidden, "heads": heads, "layers": layers, "gpus": gpus,
           "batch": batch, "paper_split": split, "paper_tflops": paper_tflops,
           "num_micro_batches": k, "micro_batch_counts": counts,
           "pipeline_layers": -(-layers // group)}
    step = make_step(False, layers_per_boundary=group)
    args = abstract_args(hidden, heads, layers, batch, scan=False)
    parts = [d for d in host_parts if hosts % d == 0]
    if len(parts) == 1:  # an odd host count: its divisors up to the largest part
        parts = [d for d in range(1, max(host_parts) + 1) if hosts % d == 0]
    shapes = sorted({(hosts // d, 8) for d in parts})
    method = autoshard.AutoParallel(
        num_micro_batches=k, micro_batch_counts=tuple(counts[1:]) or None, layer_option="manual",
        default_auto_sharding_option=AutoShardingOption(show_progress=False),
        stage_option=AutoStageOption(submesh_physical_shape_space="manual",
                                     manually_specified_submeshes=shapes,
                                     layer_profile_mode="individual"))
    t0, c0 = time.perf_counter(), time.process_time()
    cluster = Cluster.a100_80gb(hosts)
    est = autoshard.plan(step, *args, cluster=cluster, method=method, batch_argnums=(1, 2))
    row["plan_s"] = time.perf_counter() - t0
    row["plan_cpu_s"] = time.process_time() - c0  # the machine is shared: CPU seconds too
    row["load_average"] = os.getloadavg()[0]
    row["chosen_stages"] = est.num_stages
    row["chosen_micro_batches"] = est.chosen.num_micro_batches
    row["step_s"] = est.step_s
    row["memory_gib"] = est.peak_bytes_per_device / 2**30
    row["eq3_tflops"] = paper_flops(hidden, layers, batch) / (est.step_s * gpus * 1e12)
    row["candidates"] = [{"stages": c.num_stages, "micro_batches": c.num_micro_batches,
                          "step_s": c.step_s, "split": c.split,
                          "memory_gib": None if c.memory_bytes is None else
                          c.memory_bytes / 2**30, "dropped": c.dropped}
                         for c in est.candidates]
    chosen = est.chosen
    row["chosen_split"] = chosen.split or "whole mesh"
    if est.num_stages > 1:  # a PipelineEstimate (the whole mesh's plan is a ShardingPlan)
        row["link_bytes"] = link_bytes(est.estimate, cluster, batch // k)
        row["pipeline"] = pipeline_summary(est.estimate, cluster, explain=False)
    row["explain"] = est.explain()
    print(est.explain(), file=sys.stderr, flush=True)
    if split is not None:  # the paper's (t, p, d) priced by the same model, in the same run
        paper = run_paper_pipeline(name)
        row["paper_priced"] = {k: paper[k] for k in (
            "paper_tensor", "paper_pipeline", "paper_data", "num_micro_batches", "step_s",
            "eq3_tflops", "memory_gib", "bubble_fraction", "price_s", "link_bytes",
            "pipeline")}
    return row


def auto_row_in_subprocess(name: str, limit_s: float = AUTO_TIME_LIMIT_S,
                           searched: int = 1) -> dict:
    """``run_auto(name, searched=searched)`` in a child process stopped after ``limit_s``
    seconds."""
    import subprocess

    t0 = time.perf_counter()
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import cluster; print(json.dumps(cluster.run_auto({name!r}, "
            f"searched={searched})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"model": name, "plan_s": time.perf_counter() - t0,
                "stopped": f"planning stopped after {limit_s:.0f} s"}
    if done.returncode:
        return {"model": name, "plan_s": time.perf_counter() - t0,
                "error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


LINKS_HEADING = "## Bytes each GPU sends per step, by link"
"""The section of cluster_auto.md that ``write_auto`` writes after the table (``link_lines``);
any other ``## `` section already in the file (notes written by hand) is kept after it."""


def busiest_stage(links: dict) -> dict:
    """The stage of a ``link_bytes`` result whose GPUs spend longest on the links."""
    return max(links["stages"], key=lambda st: sum(p["nvlink_s"] + p["nic_s"]
                                                   for p in st["parts"].values()))


def link_lines(rows: list[dict]) -> list[str]:
    """Per pipeline row, ours and the paper's split: the bytes one GPU of the busiest stage
    sends per step on each link (``link_bytes``)."""
    shown = [r for r in rows if "link_bytes" in r]
    if not shown:
        return []
    lines = ["", LINKS_HEADING, "",
             "Per GPU of the stage whose GPUs spend longest on the links (`link_bytes`: the cost "
             "model's phases of every collective of the stage's task plans as ring bytes, a "
             "phase over an axis with k GPUs in each node sending 1/k of them through each "
             "GPU's NIC and the rest over NVLink; F and B tasks once per micro-batch, apply "
             "and the gradient reduction once per step; sends between stages on the link "
             "joining them). GB = 1e9 bytes; tensor: collectives over the stage's non-data "
             "axes; data: over its data axes inside the tasks (ZeRO gathers, reductions left "
             "in a task); reduce: the stage's once-per-step gradient all-reduce; pipeline: "
             "copies to other stages. Link s: the bytes at "
             f"{_A100.intra_host_bandwidth / 1e9:g} GB/s (NVLink) and "
             f"{_A100.inter_host_bandwidth / 1e9:g} GB/s (each GPU's NIC); charged s: what "
             "the pricing charges for them (latency and the slower of a crossing ring's "
             "links included), not overlapped with compute.", "",
             "| model | plan | micro-batches | stage (mesh) | NVLink GB: tensor / data / reduce "
             "/ pipeline | NIC GB: tensor / data / reduce / pipeline | NVLink s | NIC s | "
             "charged s: tensor / data / reduce / pipeline | step s (schedule + apply, "
             "bubble) |",
             "|---|---|---:|---|---|---|---:|---:|---|---|"]
    for r in shown:
        paper = r.get("paper_priced") or {}
        for label, links, e, step_s in (
                ("ours", r["link_bytes"], r.get("pipeline"), r["step_s"]),
                ("paper's split", paper.get("link_bytes"), paper.get("pipeline"),
                 paper.get("step_s"))):
            if links is None:
                continue
            st = busiest_stage(links)
            parts = st["parts"]

            def col(key, parts=parts):
                return " / ".join(f"{parts[p][key] / 1e9:.1f}" for p in LINK_PARTS)
            step = (f"{e['step_s']:.2f} ({e['makespan_s']:.2f} + {e['apply_s']:.2f}, "
                    f"{e['bubble_fraction']:.1%})" if e else f"{step_s:.2f}")
            lines.append(
                f"| {r['model']} | {label} | {links['num_micro_batches']} | {st['stage']} "
                f"({'x'.join(map(str, st['mesh']))}, data over {','.join(st['data_axes'])}) | "
                f"{col('nvlink_bytes')} | {col('nic_bytes')} | "
                f"{sum(p['nvlink_s'] for p in parts.values()):.2f} | "
                f"{sum(p['nic_s'] for p in parts.values()):.2f} | "
                + " / ".join(f"{parts[p]['model_s']:.2f}" for p in LINK_PARTS)
                + f" | {step} |")
    return lines


def kept_sections(path: Path) -> list[str]:
    """The ``## `` sections of an existing cluster_auto.md other than ``LINKS_HEADING``."""
    if not path.exists():
        return []
    kept, keep = [], False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            keep = line != LINKS_HEADING
        if keep:
            kept.append(line)
    return ["", *kept] if kept else []


def merge_auto(path: Path) -> list[dict]:
    """The rows of cluster_auto.json in ``RESULTS`` with those of ``path`` (another run's
    cluster_auto.json) in place of the rows of the same model, new models appended."""
    new = {r["model"]: r for r in json.loads(path.read_text())["rows"]}
    old = json.loads((RESULTS / "cluster_auto.json").read_text())["rows"]
    rows = [new.pop(r["model"], r) for r in old]
    return rows + list(new.values())


def write_auto(rows: list[dict], limit_s: float = AUTO_TIME_LIMIT_S):
    """cluster_auto.json and cluster_auto.md: the rows ``AutoParallel`` planned (the md's
    sections written by hand are kept, ``kept_sections``)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    kept = kept_sections(RESULTS / "cluster_auto.md")
    (RESULTS / "cluster_auto.json").write_text(json.dumps({"rows": rows}, indent=1))
    lines = ["# Table 1 rows planned by AutoParallel", "",
             f"`autoshard.plan(..., method=AutoParallel(...))`, {platform.machine()}, "
             f"{os.cpu_count()} CPUs (shared). Step unrolled with a pipeline boundary every "
             f"layers / {PIPELINE_LAYERS} layers, {PIPELINE_MICRO_BATCHES} micro-batches (or "
             "the next count that divides the batch; a row run with "
             "--auto-micro-batch-counts 3 searched that count and the next from 3x and 9x it: "
             "AutoParallel(micro_batch_counts=...), the counts listed), "
             "sub-meshes of hosts / (1, 2, 4, 8) whole hosts (other search spaces: "
             + "; ".join(f"{m}: {c['pipeline_layers']} pipeline layers, micro-batches "
                         f"{', '.join(map(str, c['micro_batch_counts']))}, sub-meshes of hosts / "
                         f"{', '.join(map(str, c['host_parts']))}"
                         for m, c in AUTO_ROW_SEARCH.items())
             + f", as `AUTO_ROW_SEARCH` says why); rows stopped after "
             f"{limit_s:.0f} s of planning (or the limit a stopped row names). plan s: wall "
             "seconds (CPU seconds of the planning "
             "process, and the load average at the end: the machine is shared).", "",
             "Paper's split: Table 1's (t, p, d) priced by the same model in the same run "
             "(`run_paper_pipeline`: p stages of whole hosts, t = 8 in the node, one sequence "
             "per data replica per micro-batch, 1F1B); ratio = its step time / ours (> 1: "
             "ours rated faster). Targets (issue 24): eq. 3 TFLOP/s within 1.3x of the "
             "paper's; the paper's split never rated more than 1.05x faster than ours.", "",
             "| model | GPUs | chosen (stages: layers on hosts x GPUs as mesh) | micro-batches "
             "| step s | eq. 3 TFLOP/s | paper | paper / ours | GiB | paper's split priced: "
             "(t, p, d), micro-batches, step s, eq. 3 TFLOP/s, GiB | paper split / ours "
             "| other candidates (stages: step s) | plan s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['model']} | {AUTO_ROWS[r['model']][3]} | "
                         f"{r.get('stopped') or r.get('error')} | | | | | | | | | | "
                         f"{r['plan_s']:.0f} |")
            continue
        counts = r.get("micro_batch_counts", [r["num_micro_batches"]])
        chosen_k = r.get("chosen_micro_batches", r["num_micro_batches"])

        cands = "; ".join(
            f"{candidate_label(c, r)}: {c['step_s']:.3g}" if c["step_s"] is not None
            and c["step_s"] < float("inf")
            else f"{candidate_label(c, r)}: dropped ({c['dropped']})"
            for c in r["candidates"] if (c["stages"], c.get("micro_batches", chosen_k))
            != (r["chosen_stages"], chosen_k))
        paper = r.get("paper_priced")
        priced = (f"({paper['paper_tensor']}, {paper['paper_pipeline']}, "
                  f"{paper['paper_data']}), {paper['num_micro_batches']}, "
                  f"{paper['step_s']:.3g}, {paper['eq3_tflops']:.0f}, {paper['memory_gib']:.1f}"
                  if paper else "no published split")
        ratio = f"{paper['step_s'] / r['step_s']:.2f}" if paper else ""
        vs_paper = (f"{r['paper_tflops'] / r['eq3_tflops']:.2f}" if r.get("paper_tflops")
                    else "")
        searched = f" (of {', '.join(map(str, counts))})" if len(counts) > 1 else ""
        lines.append(f"| {r['model']} | {r['gpus']} | {r['chosen_stages']}: "
                     f"{r.get('chosen_split', '')} | {chosen_k}{searched} | "
                     f"{r['step_s']:.3g} | {r['eq3_tflops']:.0f} | {r['paper_tflops'] or ''} | "
                     f"{vs_paper} | {r['memory_gib']:.1f} | {priced} | {ratio} | {cands} | "
                     f"{r['plan_s']:.0f}" + (
                         f" ({r['plan_cpu_s']:.0f} CPU, load {r['load_average']:.1f})"
                         if "plan_cpu_s" in r else "") + " |")
    lines += link_lines(rows) + kept
    (RESULTS / "cluster_auto.md").write_text("\n".join(lines) + "\n")


def candidate_label(c: dict, r: dict) -> str:
    """An ``--auto`` candidate's stage count, and its micro-batches where several were
    searched."""
    k = c.get("micro_batches", r["num_micro_batches"])
    return f"{c['stages']}" + (f" x {k} mb" if len(r.get("micro_batch_counts", [])) > 1
                               else "")


def why(r: dict) -> str:
    """The paper's plan priced by the model, beside the planner's choice."""
    ratio = r["paper_step_s"] / r["step_s"]
    verdict = (f"chosen rated {ratio:.2f}x faster" if ratio >= 1
               else f"paper's plan rated {1 / ratio:.2f}x faster")
    eq3 = f" ({r['paper_eq3_tflops']:.0f} eq. 3)" if "paper_eq3_tflops" in r else ""
    return (f"{r['paper_step_s']:.2f} s ({r['paper_compute_s']:.2f} + "
            f"{r['paper_communication_s']:.2f}), {r['paper_est_tflops']:.0f}{eq3} TFLOP/s, "
            f"{r['paper_memory_gib']:.1f} GiB: {verdict}")


def write(rows: list[dict], before: dict | None = None):
    """Write cluster.json and cluster.md; ``before``: {"label": ..., "rows": [...]} of an
    earlier run, kept in the json and compared row by row in the markdown."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "cluster": "Cluster.a100_80gb(num_hosts = GPUs / 8)", "seq": SEQ, "vocab": VOCAB}
    data = {"meta": meta, "rows": rows}
    if before is not None:
        data["before"] = before
    (RESULTS / "cluster.json").write_text(json.dumps(data, indent=1))
    lines = ["# Megatron-LM Table 1 rows planned for described A100 clusters", "",
             f"`autoshard.plan` on abstract shapes, jax {meta['jax']}, {meta['cpus']} CPUs "
             f"(shared), no GPU. Cluster: `Cluster.a100_80gb(GPUs / 8)` ({PRESET}). "
             "Split = data x tensor "
             "(+zero: weights and Adam state also split over the data axis named, gathered at "
             "use). TFLOP/s per GPU = matrix-product FLOPs of the step as traced (JAX's "
             "recompute included) / estimated step time / GPUs; eq. 3: the paper's count "
             "(`Objective.model_flops`, equal to the paper's formula for this model: the "
             "traced count is 7-8% under it). Plan s: wall time of `autoshard.plan` (trace + "
             "plan) on this 2-core machine shared with other jobs (1-minute load average "
             "during the rows: "
             + ", ".join(f"{r['model']} {r['layers_as']} {r['load_average']:.1f}"
                         for r in rows if "load_average" in r) + ").", "",
             "| model | GPUs | layers as | plan s | mesh | split (data x tensor) | paper split "
             "| est. step s (compute + comm) | est. TFLOP/s/GPU traced (eq. 3) | paper "
             "TFLOP/s/GPU (eq. 3) | memory GiB/GPU | the paper's plan priced by the same "
             "model: step s (compute + comm), TFLOP/s/GPU traced (eq. 3), memory |",
             "|---|---:|---|---:|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        if r["layers_as"] == "pipeline":
            continue
        paper = f"{r['paper_data']} x {r['paper_tensor']}" + (
            f" x pipeline {r['paper_pipeline']}" if r["paper_pipeline"] > 1 else "")
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['gpus']} | - | - | - | not planned: "
                         f"{r['skipped']} | {paper} | - | - | {r['paper_tflops']} | - | - |")
            continue
        zero = f" +zero({','.join(r['zero_axes'])})" if r["zero_axes"] else ""
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['layers_as']} | {r['plan_s']:.1f}"
            + (f" ({r['plan_s_without_cutoff']:.1f} with every mesh solved: "
               f"{r['plan_s_without_cutoff'] / r['plan_s']:.1f}x"
               f"{', same plan' if r.get('same_plan_without_cutoff') else ', OTHER PLAN'})"
               if "plan_s_without_cutoff" in r else "") + " "
            f"| {'x'.join(map(str, r['mesh']))} | {r['data']} x {r['tensor']}{zero} | {paper} "
            f"| {r['step_s']:.2f} ({r['compute_s']:.2f} + {r['communication_s']:.2f}) "
            f"| {r['tflops']:.0f}{eq3_of(r)} | {r['paper_tflops']} | {r['memory_gib']:.1f}"
            f"{' (over 80 GiB)' if r['memory_gib'] > 80 else ''} "
            f"| {why(r) if 'paper_step_s' in r else unpriced(r, rows)} |")
    lines += ["", "Paper figures: " + SOURCE + ". The last column prices the paper's plan "
              "itself with `autoshard.plan`: the inputs in Megatron's specs "
              "(`ManualShardingOption`: QKV and first MLP matrix split by columns, attention "
              "output and second MLP matrix by rows, embedding by vocabulary over `model`, Adam "
              "moments as their weights, batch over `data`) and the activations pinned to "
              "Megatron's layout (`with_sharding_constraint` on an `AbstractMesh`: residual "
              "stream split by batch over `data`, QKV, attention probabilities and outputs by "
              "heads and the MLP hidden and logits by features over `model`) on the paper's "
              "(data, tensor) mesh; the planner places only the values left unpinned (layer "
              "norms, gradients).", "",
              "Meshes the planner compared (estimated step time; pruned ones with why):", ""]
    for r in rows:
        if "skipped" in r or r["layers_as"] == "pipeline":
            continue
        tried = ", ".join(f"{tuple(s)} {v:.2f} s" for s, v in sorted(r["meshes_tried"],
                                                                      key=lambda t: t[1]))
        pruned = "; ".join(f"{tuple(s)}: {why}" for s, why in r["meshes_pruned"])
        lines.append(f"- {r['model']} ({r['layers_as']}): {tried}" + (
            f". Not solved: {pruned}" if pruned else ""))
    lines += ["", "FLOPs check: the step's counted FLOPs / the paper's formula (eq. 3): "
              + ", ".join(f"{r['model']} {r['flops'] / r['paper_formula_flops']:.2f}"
                          for r in rows if "flops" in r) + "."]
    lines += pipeline_lines(rows)
    if before is not None:
        lines += moved_lines(rows, before)
    (RESULTS / "cluster.md").write_text("\n".join(lines) + "\n")


def eq3_of(r: dict) -> str:
    return f" ({r['eq3_tflops']:.0f})" if "eq3_tflops" in r else ""


def _key(r: dict) -> tuple:
    return r["model"], r["layers_as"]


def moved_lines(rows: list[dict], before: dict) -> list[str]:
    """Row by row: the estimates of an earlier run (``before``) beside this run's."""
    old = {_key(r): r for r in before["rows"]}
    lines = ["", f"## What moved: {before['label']}", "",
             "Each row planned twice, by the code before and after (same script, same "
             "machine); TFLOP/s per GPU as eq. 3 counts (the paper's formula / estimated step "
             "time / GPUs), the paper's Table 1 figure beside them. Ratio = the paper's plan "
             "priced by the same model / the planner's plan (> 1: the planner's rated faster).",
             "Memory-bound s = compute s less the products' time at the sustained FLOP/s "
             "of the preset each run used (the traced FLOPs / GPUs / that rate: "
             f"{sustained(before['rows'][0]) / 1e12:.0f} before, {SUSTAINED / 1e12:.0f} "
             "after).",
             "", "| model | layers as | mesh before -> after | est. step s before -> after "
             "(compute + comm) | memory-bound s before -> after | eq. 3 TFLOP/s before -> "
             "after | paper TFLOP/s | paper's plan step s before -> after | ratio before -> "
             "after |",
             "|---|---|---|---|---|---|---:|---|---|"]

    def step_of(r):
        if r["layers_as"] == "pipeline":
            e = r["planned_pipeline"]
            return e["step_s"], e["makespan_s"], e["apply_s"], None
        return r["step_s"], r["compute_s"], r["communication_s"], r["mesh"]

    def paper_of(r):
        if r["layers_as"] == "pipeline":
            return r["paper_pipeline_priced"]["step_s"]
        return r.get("paper_step_s")

    def eq3(r):
        s = step_of(r)[0]
        hidden, _, layers, gpus, batch = ROWS[r["model"]][:5]
        return paper_flops(hidden, layers, batch) / s / gpus / 1e12

    for r in rows:
        b = old.get(_key(r))
        if b is None or "skipped" in r or "skipped" in b:
            continue
        (s0, c0, m0, mesh0), (s1, c1, m1, mesh1) = step_of(b), step_of(r)
        p0, p1 = paper_of(b), paper_of(r)
        mesh = ("stage search" if mesh0 is None else
                f"{'x'.join(map(str, mesh0))} -> {'x'.join(map(str, mesh1))}")
        paper = f"{p0:.2f} -> {p1:.2f}" if p0 and p1 else "-"
        ratio = f"{p0 / s0:.2f} -> {p1 / s1:.2f}" if p0 and p1 else "-"
        memory = (f"{memory_bound_s(b):.2f} -> {memory_bound_s(r):.2f}"
                  if r["layers_as"] != "pipeline" else "-")
        lines.append(f"| {r['model']} | {r['layers_as']} | {mesh} | {s0:.2f} ({c0:.2f} + "
                     f"{m0:.2f}) -> {s1:.2f} ({c1:.2f} + {m1:.2f}) | {memory} | {eq3(b):.0f} "
                     f"-> {eq3(r):.0f} | {r['paper_tflops']} | {paper} | {ratio} |")
    if any(r["layers_as"] == "pipeline" for r in rows):
        lines += ["", "Pipeline rows: compute + comm read schedule + apply."]
    lines += ["", *before.get("notes", [])]
    return lines


SUSTAINED = Cluster.a100_80gb(1).peak_flops * Cluster.a100_80gb(1).flops_efficiency
"""FLOP/s the preset's compute term gives matrix products."""
_A100 = Cluster.a100_80gb(1)
PRESET = (f"{_A100.peak_flops / 1e12:g} TFLOP/s bf16 x {_A100.flops_efficiency:g}, "
          f"{_A100.memory_bandwidth / 1e12:g} TB/s memory, 80 GiB, NVLink "
          f"{_A100.intra_host_bandwidth / 1e9:g} GB/s, {_A100.inter_host_bandwidth / 1e9:g} GB/s "
          f"per GPU between nodes: 8 NICs, {_A100.host_network_bandwidth / 1e9:g} GB/s per node")
"""The preset's figures, as the results' header states them."""


def sustained(r: dict) -> float:
    """The sustained FLOP/s of the preset a row was planned with (rows from before it was
    recorded: 0.8 of 312 TFLOP/s)."""
    return r.get("sustained_flops", 312e12 * 0.8)


def memory_bound_s(r: dict) -> float:
    """Seconds of a row's compute term not spent in matrix products."""
    return r["compute_s"] - r["flops"] / r["gpus"] / sustained(r)


def unpriced(r: dict, rows: list[dict]) -> str:
    """The last column of a row whose paper plan is a pipeline: where it is priced."""
    piped = next((x for x in rows if x["model"] == r["model"]
                  and x["layers_as"] == "pipeline" and "paper_pipeline_priced" in x), None)
    if piped is None:
        return r.get("paper_unpriced", "-")
    e = piped["paper_pipeline_priced"]
    return (f"a pipeline (tensor {r['paper_tensor']} x pipeline {r['paper_pipeline']}): "
            f"priced with PipeshardParallel below, {e['step_s']:.2f} s, {e['tflops']:.0f} "
            f"TFLOP/s, {e['memory_gib']:.1f} GiB")


def pipeline_lines(all_rows: list[dict]) -> list[str]:
    """The pipelined rows: the stage search's plan and the paper's stages, both priced."""
    rows = [r for r in all_rows if r["layers_as"] == "pipeline"]
    if not rows:
        return []
    lines = ["", "## With a pipeline (PipeshardParallel priced by `autoshard.plan`)", "",
             "The step unrolled, a `mark_pipeline_boundary()` every 6 transformer layers (8 "
             "pipeline layers), `autoshard.value_and_grad`, 1F1B. Each task (F, B, apply) of a "
             "stage is planned by the planner on its sub-mesh's cluster; a stage's time per "
             "micro-batch is its planned F + B (a B whose rows arrive split over data axes "
             "keeps its weight gradients partial over them; the stage's reduce task "
             "all-reduces them once per step before apply, as Megatron does and as "
             "autoshard's pipeline runtime runs it), "
             "activations cross sub-meshes on the link joining them, and the step is the "
             "replayed schedule plus the apply tasks. The micro-batch count is our choice "
             "(Table 1 gives none).", "",
             "| model | GPUs | micro-batches | plan | stages: layers on (hosts x GPUs), mesh | "
             "est. step s (schedule + apply) | bubble | est. TFLOP/s/GPU traced (eq. 3) | "
             "paper TFLOP/s/GPU "
             "| memory GiB/GPU | plan s |",
             "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for label, key, secs in (("stage search (AutoStageOption)", "planned_pipeline",
                                  "plan_s"),
                                 (f"paper's: pipeline {r['paper_pipeline']} x data "
                                  f"{r['paper_data']} x tensor {r['paper_tensor']}",
                                  "paper_pipeline_priced", "paper_price_s")):
            e = r.get(key)
            if e is None:
                continue
            stages = "; ".join(
                f"{s['layers'][0]}-{s['layers'][1]} on {s['physical_shape'][0]}x"
                f"{s['physical_shape'][1]}, mesh {'x'.join(map(str, s['mesh']))}"
                for s in e["stages"])
            lines.append(
                f"| {r['model']} | {r['gpus']} | {r['num_micro_batches']} | {label} | {stages} "
                f"| {e['step_s']:.2f} ({e['makespan_s']:.2f} + {e['apply_s']:.2f}) "
                f"| {e['bubble_fraction']:.1%} | {e['tflops']:.0f}{eq3_of(e)} | {r['paper_tflops']} "
                f"| {e['memory_gib']:.1f} | {r[secs]:.0f} |")
    for r in rows:
        e = r.get("paper_pipeline_priced")
        flat = next((x for x in all_rows if x["model"] == r["model"]
                     and x["layers_as"] == "scan" and "step_s" in x), None)
        if e is None:
            continue
        comm = [s.get("backward_communication_s") for s in e["stages"]]
        b = [s["task_s"].get("B") for s in e["stages"]]
        red = [(s.get("reduce_bytes"), s.get("reduce_s")) for s in e["stages"]]
        if None not in comm and None not in b and all(x is not None for x, _ in red):
            lines += ["", f"{r['model']}: in the paper's stages, every backward (one per "
                      "micro-batch) takes " + ", ".join(
                          f"{t:.2f} s of which {c:.2f} s communicating" for c, t in zip(
                              comm, b, strict=True))
                      + " (stage by stage); the weight gradients are reduced once per step "
                      "over the data axis: " + ", ".join(
                          f"{x / 2**30:.2f} GiB per GPU in {y:.2f} s" for x, y in red)
                      + f" (in the apply time), of the {e['step_s']:.2f} s step"
                      + (f"; the planner's plan without a pipeline (the scan row above) "
                         f"takes {flat['step_s']:.2f} s" if flat else "") + "."]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--unroll", action="store_true", help="layers as a Python loop")
    parser.add_argument("--both", action="store_true", help="scan rows, then unrolled rows")
    parser.add_argument("--pipeline", action="store_true",
                        help="plan the pipeline rows (39.1B) with PipeshardParallel")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout rate of the GPT (Megatron-LM's runs: 0.1)")
    parser.add_argument("--rewrite", action="store_true", help="only rewrite cluster.md")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in cluster.json, add these after them")
    parser.add_argument("--out", type=Path, help="results directory (default: results/)")
    parser.add_argument("--before", type=Path,
                        help="cluster.json of an earlier run: kept and compared row by row")
    parser.add_argument("--before-label", default="an earlier run",
                        help="what the earlier run was (shown in the comparison)")
    parser.add_argument("--before-notes", type=Path,
                        help="text file: paragraphs shown under the comparison (why it moved)")
    parser.add_argument("--auto", nargs="+", choices=list(AUTO_ROWS),
                        help="plan these rows with AutoParallel (cluster_auto.{json,md})")
    parser.add_argument("--paper-pipelines", nargs="+",
                        choices=[n for n, r in AUTO_ROWS.items() if r[5] and r[5][1] > 1],
                        help="price the paper's pipeline of these rows "
                             "(cluster_paper_pipelines.{json,md})")
    parser.add_argument("--auto-merge", type=Path,
                        help="another run's cluster_auto.json: its rows replace those of the "
                             "same model in cluster_auto.json (the others kept); rewrites the md")
    parser.add_argument("--auto-time-limit", type=float, default=AUTO_TIME_LIMIT_S,
                        help="seconds after which an --auto row is stopped (default "
                             f"{AUTO_TIME_LIMIT_S}; raise it on a loaded machine)")
    parser.add_argument("--auto-micro-batch-counts", type=int, default=1,
                        help="micro-batch counts an --auto row searches (micro_batch_counts: "
                             "the fewest from 16 up dividing the batch, then from 3x and 9x "
                             "it; default 1)")
    args = parser.parse_args(argv)
    global RESULTS, DROPOUT
    DROPOUT = args.dropout
    if args.out is not None:
        RESULTS = args.out
    saved = (json.loads((RESULTS / "cluster.json").read_text())
             if args.rewrite or args.append else {})
    before = saved.get("before")
    if args.before is not None:
        before = {"label": args.before_label,
                  "rows": json.loads(args.before.read_text())["rows"]}
        if args.before_notes is not None:
            before["notes"] = args.before_notes.read_text().split("\n\n")
    if args.rewrite:
        write(saved["rows"], before)
        return
    if args.paper_pipelines:
        rows = []
        for name in args.paper_pipelines:
            try:
                rows.append(run_paper_pipeline(name) | {"dropout": DROPOUT})
            except (ValueError, RuntimeError) as err:
                rows.append({"model": name, "error": f"{type(err).__name__}: "
                                                     f"{str(err).splitlines()[0][:200]}"})
            write_paper_pipelines(rows)
        return
    if args.auto_merge:
        write_auto(merge_auto(args.auto_merge), args.auto_time_limit)
        return
    if args.auto:
        rows = []
        for name in args.auto:
            rows.append(auto_row_in_subprocess(name, args.auto_time_limit,
                                               args.auto_micro_batch_counts))
            write_auto(rows, args.auto_time_limit)
        return
    modes = [True, False] if args.both else [not args.unroll]
    rows = saved["rows"] if args.append else []
    if args.pipeline:
        for name in args.rows:
            if name in PIPELINE_ROWS:
                rows = [r for r in rows if not (r["model"] == name
                                                and r["layers_as"] == "pipeline")]
                rows.append(run_pipeline(name))
                write(rows, before)
        return
    for scan in modes:
        for name in args.rows:
            if name in PIPELINE_ROWS and not scan:
                continue
            rows.append(run(name, scan))
            print(json.dumps({k: v for k, v in rows[-1].items()
                              if not k.startswith("meshes")}), file=sys.stderr, flush=True)
            write(rows, before)


if __name__ == "__main__":
    main()
