"""Benchmarks of ds_pipe_ckpt, run from the repository root: ``python -m benchmarks.checkpointing``."""
