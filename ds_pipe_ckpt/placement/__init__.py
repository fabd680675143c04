"""Where a checkpointed region's saved inputs live between its forward and its
recomputation: partitioned across the model-parallel group, offloaded to host
memory, in pooled buffers (DeepSpeed's ``partition_activations``,
``cpu_checkpointing``, ``contiguous_memory_optimization``), with boundary
synchronisation and profiling.

* :mod:`.runtime`: the state the checkpoints of one configuration share, and
  the per-region placement that :class:`ds_pipe_ckpt.inputs.SavedInputs` hands
  a region's inputs to;
* :mod:`.stash`: one region's stored inputs (pack, shard/offload, gather);
* :mod:`.pack`: the byte layout the inputs are packed into;
* :mod:`.kernels` / :mod:`.op_builder`: the optional CUDA pack/unpack ops
  (``csrc/``) and their pure-torch fallback;
* :mod:`.pool`: the pooled buffers;
* :mod:`.profiling`: per-checkpoint timings.

This ``__init__`` imports nothing, so that the kernel modules, which need only
torch, import on machines without DeepSpeed (``tests/gpu``).
"""
