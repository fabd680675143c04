"""A pipeline stage trained in the test process as DeepSpeed's engine drives
one: each micro-batch's forward and backward, then the optimizer step."""

from __future__ import annotations


def train_step(module, optimizer, micro_batches) -> float:
    """One step over ``micro_batches`` (a loss of the squared outputs); the sum of their losses."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x in micro_batches:
        loss = module(x).pow(2).mean()
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total
