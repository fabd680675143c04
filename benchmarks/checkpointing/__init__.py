"""The per-call benchmark: every activation-checkpointing path on one pipeline
stage, outside DeepSpeed's engine, beside upstream DeepSpeed's and torch's
checkpoints (``python -m benchmarks.checkpointing``, :mod:`.runner`), and the
per-call cost on many tiny regions (``python -m
benchmarks.checkpointing.region_loop``).

Its measurement (:mod:`.workloads`, :mod:`.variants`, :mod:`.measure`,
:mod:`.floor`, :mod:`.call_profile`) feeds :mod:`.runner`, which alone prints,
through :mod:`.report`. Nothing here imports :mod:`benchmarks.pipeline`. This
file imports nothing, so that ``region_loop`` starts without what the runner
loads.
"""
