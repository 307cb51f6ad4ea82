"""The intermediate representation every pass shares: JAX internals (``_compat``, the
only module that touches them), the one jaxpr walker (``_walk``), the primitive tables
(``_prims``), tracing helpers (``_jaxpr``, ``_program``) and the per-device evaluator
(``_local*``). Nothing here imports a method, the planner or the front end."""
