"""What runs inside each process that ``autoshard.launch`` starts.

``main([PAYLOAD, RESULT])`` (a fresh interpreter started by the local backend) reads the pickled ``(fn, args)``,
joins the job (``autoshard.init``), runs ``fn(*args)`` and writes ``("ok", result)`` or
``("error", exception, traceback text)`` to RESULT (atomically: a reader never sees half a
file). Ray actors call ``run_payload`` directly. A worker whose launching process is gone exits
on its own, so no process outlives the launch.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback


def _pickler():
    """cloudpickle when present (functions of ``__main__`` and lambdas travel by value)."""
    try:
        import cloudpickle
    except ImportError:
        try:
            from ray import cloudpickle
        except ImportError:
            return pickle
    return cloudpickle


def dumps(obj) -> bytes:
    return _pickler().dumps(obj)


def loads(data: bytes):
    return pickle.loads(data)


def run_payload(payload: bytes, *, cluster: str = "distributed") -> tuple[bool, bytes]:
    """Join the job, run ``fn(*args)``; (succeeded, pickled outcome). Never raises."""
    import autoshard

    try:
        fn, args = loads(payload)
        autoshard.init(cluster)
        result = fn(*args)
    except BaseException as e:  # reported to the caller with this process's rank
        return False, _error(e)
    try:
        return True, dumps(("ok", result))
    except Exception as e:
        return False, _error(TypeError(
            f"the result of {getattr(fn, '__name__', fn)!r} ({type(result).__name__}) could not "
            f"be pickled back to the launching process: {e}. Return host values: numpy arrays "
            "(np.asarray of a fully replicated array, or jax.experimental.multihost_utils."
            "process_allgather), numbers or strings."))


def _error(e: BaseException) -> bytes:
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        return dumps(("error", e, text))
    except Exception:
        return dumps(("error", None, text))


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process as soon as ``parent_pid`` is no longer its parent."""
    def loop():
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(70)

    threading.Thread(target=loop, name="autoshard-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    payload_path, result_path = argv
    from .. import _config

    parent = _config.launch_parent_pid()
    if parent is not None:
        watch_parent(parent)
    with open(payload_path, "rb") as f:
        ok, outcome = run_payload(f.read())
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        f.write(outcome)
    os.replace(tmp, result_path)
    if ok:
        import autoshard

        autoshard.shutdown()  # a barrier with the other processes, then the runtime is gone
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a failed process must not wait in JAX's exit handlers for
    # peers that will never arrive (the launcher stops them).
    os._exit(0 if ok else 1)
