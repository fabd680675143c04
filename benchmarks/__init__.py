"""Benchmarks of ds_pipe_ckpt, one package per subject, run from the repository root: ``python -m
benchmarks.checkpointing`` (one checkpointed call) and ``python -m benchmarks.pipeline`` (stages in
DeepSpeed's engine); :mod:`.common` is what both record the same way."""
