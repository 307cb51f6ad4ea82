"""The parallel methods: the one interface (``_base.ParallelMethod``: compile an
executable on devices, or plan for a described cluster), the public method classes
(``_methods``), and what each runs: ShardParallel's automatic plan (``_auto``) or
hand-written one (``_manual``), data parallelism and ZeRO (``_data``), meshes
(``_mesh``). ``PipeshardParallel`` lives with its machinery in ``pipeline/``."""
