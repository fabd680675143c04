"""How a checkpointed function is named and recognised from call to call
(what was learned on its first call is kept per region)."""

import functools
import gc

import torch.nn as nn

from ds_pipe_ckpt.regions import RegionRegistry, describe_callable, region_key


class Block(nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


class Wrapped(Block):
    """As transformers does: ``forward`` replaced by a ``functools.wraps`` wrapper."""

    @functools.wraps(Block.forward)
    def forward(self, *args, **kwargs):
        return Block.forward(self, *args, **kwargs)


def test_names_are_what_the_user_wrote():
    block = Block()
    assert describe_callable(block) == "Block"
    assert describe_callable(block.forward) == "Block.forward"
    assert describe_callable(functools.partial(Block.forward, block, scale=2.0)) == "Block.forward"
    assert describe_callable(functools.partial(block, scale=2.0)) == "Block"
    assert describe_callable(len) == "len"


def test_a_region_is_recognised_across_calls_that_build_new_callables():
    block, layer = Block(), nn.Linear(2, 2)
    make_partial = lambda: functools.partial(Block.forward, block, scale=2.0)  # noqa: E731
    assert region_key(make_partial())[0] == region_key(make_partial())[0] == region_key(block.forward)[0]
    make_lambda = lambda: (lambda x: layer(x))  # noqa: E731
    assert region_key(make_lambda())[0] == region_key(make_lambda())[0]
    other = Block()
    assert region_key(functools.partial(Block.forward, other))[0] != region_key(make_partial())[0]
    # transformers checkpoints partial(<the original forward>, layer) of a class whose
    # forward it replaced with a wrapper: still that layer's region, not the class's.
    first, second = Wrapped(), Wrapped()
    assert region_key(functools.partial(Block.forward, first))[0] != region_key(functools.partial(Block.forward, second))[0]


def test_learned_facts_are_kept_per_region_and_not_passed_to_a_new_object():
    registry = RegionRegistry()
    block = Block()
    facts = registry.facts_for(block)
    facts.mutated_inputs = frozenset({0})
    assert registry.facts_for(block) is facts
    address = id(block)
    del block
    gc.collect()
    for _ in range(100):  # a new object may reuse the address: it must not inherit the facts
        newcomer = Block()
        if id(newcomer) == address:
            break
    assert not registry.facts_for(newcomer).learned


def test_the_registry_is_bounded():
    registry = RegionRegistry(capacity=3)
    blocks = [Block() for _ in range(5)]
    for block in blocks:
        registry.facts_for(block).mutated_inputs = frozenset()
    assert len(registry) == 3
    assert not registry.facts_for(blocks[0]).learned and registry.facts_for(blocks[4]).learned
