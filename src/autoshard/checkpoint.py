"""Checkpoints with Orbax: save sharded state, restore it onto any mesh or plan.

``save_checkpoint`` writes step ``step`` of a pytree of (possibly multi-process, sharded)
arrays to ``ckpt_dir/<step>``: every process writes the shards it owns. Orbax writes into a
temporary directory and renames it when every process is done, so a save interrupted by a crash
leaves no ``<step>`` directory behind, only a temporary one that ``checkpoint_steps`` ignores and
the next save of that step removes; the previous steps stay restorable.
``restore_checkpoint`` reads shapes and dtypes from the checkpoint and places every leaf with
the sharding given for it: restoring onto another mesh, another plan or another number of
processes reshards as it reads.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import jax
from jax.sharding import Sharding

from .ir import _compat

_STEP = re.compile(r"^\d+$")
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError(
            "Checkpoints need Orbax: pip install 'autoshard[checkpoint]' "
            "(orbax-checkpoint).") from None
    return ocp


def save_checkpoint(ckpt_dir: str | os.PathLike, target: Any, step: int) -> str:
    """Save ``target`` (a pytree of arrays) as step ``step``; returns the step's directory.

    Every process of a multi-process job must call it with the same ``step``. Atomic: the
    directory ``ckpt_dir/<step>`` appears only once the whole step is written.
    """
    _check_step(step)
    root = _root(ckpt_dir)
    path = os.path.join(root, str(step))
    if os.path.exists(path):
        raise ValueError(
            f"step {step} already exists in {root}. Save under a new step number, or delete "
            f"{path} first.")
    if jax.process_index() == 0:
        _remove_interrupted(root, step)
    client = _compat.distributed_client()
    if client is not None and jax.process_count() > 1:  # nobody writes before the cleanup ends
        client.wait_at_barrier(f"autoshard/checkpoint/{root}/{step}/cleanup", 300_000)
    ocp = _orbax()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, target)
        checkpointer.wait_until_finished()
    return path


def restore_checkpoint(ckpt_dir: str | os.PathLike, step: int | None,
                       placement_specs: Any) -> Any:
    """The pytree saved as ``step`` (None: the latest), each leaf placed as ``placement_specs`` says.

    ``placement_specs``: a pytree like the saved one whose leaves are shardings (e.g.
    ``executable.get_input_placement_specs()[0]`` for a train state) or ``jax.ShapeDtypeStruct``s
    with a sharding (their shape and dtype are checked against the checkpoint). The mesh may
    differ from the one the checkpoint was saved from: leaves are resharded as they are read.
    """
    root = _root(ckpt_dir)
    steps = checkpoint_steps(root)
    if step is None:
        if not steps:
            raise FileNotFoundError(
                f"No complete checkpoint in {root}. Save one with autoshard.save_checkpoint.")
        step = steps[-1]
    _check_step(step)
    if step not in steps:
        raise FileNotFoundError(
            f"step {step} is not a complete checkpoint in {root}; complete steps: {steps}. "
            "Restore one of those (an interrupted save leaves no step behind).")
    path = os.path.join(root, str(step))
    ocp = _orbax()
    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path)
        saved = _saved_leaves(getattr(metadata, "item_metadata", metadata))
        abstract = _abstract_target(placement_specs, saved, step)
        return checkpointer.restore(path, abstract)


def checkpoint_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """The complete steps in ``ckpt_dir``, in increasing order (interrupted saves excluded)."""
    root = _root(ckpt_dir)
    if not os.path.isdir(root):
        return []
    return sorted(int(name) for name in os.listdir(root)
                  if _STEP.match(name) and os.path.isdir(os.path.join(root, name)))


def _abstract_target(placement_specs, saved: dict, step: int):
    is_spec = lambda x: isinstance(x, Sharding | jax.ShapeDtypeStruct)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(placement_specs, is_leaf=is_spec)
    leaves = []
    for keypath, spec in flat:
        key = _normalize(keypath)
        name = jax.tree_util.keystr(keypath)
        if not is_spec(spec) or getattr(spec, "sharding", spec) is None:
            raise TypeError(
                f"placement_specs{name} ({spec!r}) must be a jax.sharding.Sharding or a "
                "jax.ShapeDtypeStruct with a sharding; take them from "
                "executable.get_input_placement_specs().")
        if key not in saved:
            known = ", ".join(".".join(k) for k in list(saved)[:8])
            raise ValueError(
                f"placement_specs{name} has no leaf in checkpoint step {step} (saved leaves: "
                f"{known}{', ...' if len(saved) > 8 else ''}). Pass placement specs shaped "
                "like the saved pytree.")
        shape, dtype = saved[key]
        if isinstance(spec, jax.ShapeDtypeStruct) and (
                tuple(spec.shape) != shape or spec.dtype != dtype):
            raise ValueError(
                f"placement_specs{name} is {spec.dtype}{list(spec.shape)}, but step {step} saved "
                f"{dtype}{list(shape)}. Restore with the shapes that were saved.")
        sharding = getattr(spec, "sharding", spec)
        leaves.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _saved_leaves(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    return {_normalize(keypath): (tuple(m.shape), jax.numpy.dtype(m.dtype))
            for keypath, m in flat}


def _normalize(keypath) -> tuple[str, ...]:
    """A key path as strings, the same for a dataclass attribute and the dict key Orbax saved."""
    out = []
    for k in keypath:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def _remove_interrupted(root: str, step: int) -> None:
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        match = _TMP.match(name)
        if match and int(match.group(1)) == step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _check_step(step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step ({step!r}) must be a non-negative int (the training step).")


def _root(ckpt_dir) -> str:
    if not isinstance(ckpt_dir, str | os.PathLike):
        raise TypeError(f"ckpt_dir ({ckpt_dir!r}) must be a path (str or os.PathLike).")
    return os.path.abspath(os.fspath(ckpt_dir))


__all__ = ["checkpoint_steps", "restore_checkpoint", "save_checkpoint"]
