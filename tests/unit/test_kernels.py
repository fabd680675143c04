"""The packed layout, the pure-torch pack/unpack, and the compiled ops: built
from csrc/ (cached by source hash, so one build per source version), registered,
and bit-identical to the fallback through their CPU implementation (which runs
the same planning code as the CUDA kernel). GPU checks: tests/gpu/."""

from __future__ import annotations

import random
import time

import pytest
import torch

from ds_pipe_ckpt.placement import kernels, op_builder
from ds_pipe_ckpt.placement.pack import ALIGNMENT, PackLayout, byte_view, pack_fallback, unpack_fallback

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]


def _random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = [rng.randint(1, 9) for _ in range(rng.randint(0, 3))]
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _naive_packed(tensors, offsets, total):
    """The layout's bytes, built the obvious way."""
    buffer = torch.zeros(total, dtype=torch.uint8)
    for t, offset in zip(tensors, offsets):
        raw = byte_view(t.contiguous())
        buffer[offset:offset + raw.numel()] = raw
    return buffer


def _random_case(seed):
    rng = random.Random(seed)
    tensors = [_random_tensor(rng, rng.choice(DTYPES)) for _ in range(rng.randint(1, 6))]
    world = rng.choice([1, 2, 3, 4, 8])
    return tensors, PackLayout.plan(tensors, world), rng.randrange(world)


# -- layout ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(30))
def test_layout_is_aligned_padded_and_covers_every_byte(seed):
    tensors, layout, _ = _random_case(seed)
    assert all(slot.offset % ALIGNMENT == 0 for slot in layout.slots)
    assert layout.shard_bytes % ALIGNMENT == 0
    assert layout.total_bytes >= layout.used_bytes > layout.total_bytes - layout.world_size * ALIGNMENT - ALIGNMENT
    ends = [s.offset + s.nbytes for s in layout.slots]
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout.slots[1:]))


def test_views_keep_dense_strides_and_make_gapped_tensors_contiguous():
    base = torch.randn(4, 6)
    tensors = [base.t(), torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), base[:, ::2], base]
    layout = PackLayout.plan(tensors)
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
    pack_fallback(layout.storage_views(tensors), layout.offsets, 0, buffer)
    restored = layout.views(buffer)
    for original, view in zip(tensors, restored):
        assert torch.equal(original, view)
    assert restored[0].stride() == tensors[0].stride()
    assert restored[1].stride() == tensors[1].stride()
    assert restored[2].is_contiguous()
    fresh, storage = layout.empty(torch.device("cpu"))
    unpack_fallback(buffer, layout.offsets, storage)
    assert [t.stride() for t in fresh] == [t.stride() for t in restored]
    assert all(torch.equal(a, b) for a, b in zip(fresh, tensors))


# -- fallback -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_fallback_pack_gathers_to_the_naive_buffer_and_unpacks_exactly(seed):
    tensors, layout, _ = _random_case(seed)
    views = layout.storage_views(tensors)
    expected = _naive_packed(tensors, layout.offsets, layout.total_bytes)
    shards = []
    for rank in range(layout.world_size):
        shard = torch.full((layout.shard_bytes, ), 0xAB, dtype=torch.uint8)  # garbage: must be overwritten
        pack_fallback(views, layout.offsets, layout.shard_begin(rank), shard)
        shards.append(shard)
    gathered = torch.cat(shards)
    assert torch.equal(gathered, expected)
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    unpack_fallback(gathered, layout.offsets, outs)
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))


def test_fallback_rejects_bad_arguments_like_the_op():
    t = torch.randn(4, 4)
    out = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        pack_fallback([t.t()], [0], 0, out)
    with pytest.raises(RuntimeError, match="must not overlap"):
        pack_fallback([t, t], [0, 32], 0, out)
    with pytest.raises(RuntimeError, match="uint8"):
        pack_fallback([t], [0], 0, out.float())
    with pytest.raises(RuntimeError, match="needs bytes"):
        unpack_fallback(out, [16], [t])


def test_cpu_tensors_use_the_fallback_here():
    status = kernels.status()
    if not torch.cuda.is_available():
        assert status.path == "fallback" and status.reason in ("no CUDA device is visible",
                                                                "torch is a CPU-only build")
    t = torch.arange(5, dtype=torch.float32)
    out = torch.empty(32, dtype=torch.uint8)
    kernels.pack([t], [0], 0, out)
    assert torch.equal(out[:20], byte_view(t)) and not out[20:].any()


# -- compiled ops ---------------------------------------------------------------------

needs_toolchain = pytest.mark.skipif(
    torch.version.cuda is None or op_builder.cuda_home() is None or op_builder.host_compiler() is None,
    reason="building csrc/ needs a CUDA build of torch, nvcc and a host C++ compiler")


@pytest.fixture(scope="module")
def ops_library():
    started = time.perf_counter()
    cached = op_builder.cached_library() is not None
    library = op_builder.build()
    elapsed = time.perf_counter() - started
    print(f"\nds_pipe_ckpt ops: {'cached' if cached else 'built'} in {elapsed:.1f} s: {library}")
    kernels.load_library(library)
    return library


@needs_toolchain
def test_ops_build_and_register(ops_library):
    assert ops_library.name == op_builder.LIBRARY_NAME
    assert kernels.ops_registered()
    assert str(torch.ops.ds_pipe_ckpt.pack.default._schema) == (
        "ds_pipe_ckpt::pack(Tensor[] tensors, int[] offsets, int begin, Tensor(a!) out) -> ()")
    assert str(torch.ops.ds_pipe_ckpt.unpack.default._schema) == (
        "ds_pipe_ckpt::unpack(Tensor buffer, int[] offsets, Tensor(a!)[] outs) -> ()")
    for name in ("pack", "unpack"):
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ds_pipe_ckpt::{name}", key), (name, key)


@needs_toolchain
@pytest.mark.parametrize("seed", range(40))
def test_op_cpu_implementation_matches_the_fallback_bit_for_bit(ops_library, seed):
    tensors, layout, rank = _random_case(seed)
    views = layout.storage_views(tensors)
    rng = random.Random(seed)
    # Also arbitrary (unaligned) offsets and shard boundaries, which the ops accept.
    offsets = list(layout.offsets)
    if seed % 2:
        offsets, cursor = [], rng.randint(0, 5)
        for t in views:
            offsets.append(cursor)
            cursor += t.numel() * t.element_size() + rng.randint(0, 3)
    begin = layout.shard_begin(rank) + (rng.randint(0, 7) if seed % 3 == 0 else 0)
    size = layout.shard_bytes + (rng.randint(0, 9) if seed % 5 == 0 else 0)
    expected = torch.full((size, ), 0x5A, dtype=torch.uint8)
    got = expected.clone()
    pack_fallback(views, offsets, begin, expected)
    torch.ops.ds_pipe_ckpt.pack(views, offsets, begin, got)
    assert torch.equal(got, expected)

    buffer = torch.randint(0, 256, (offsets[-1] + views[-1].numel() * views[-1].element_size() + 3, ),
                           dtype=torch.uint8)
    expected_outs = [torch.empty_like(t) for t in views]
    got_outs = [torch.empty_like(t) for t in views]
    unpack_fallback(buffer, offsets, expected_outs)
    torch.ops.ds_pipe_ckpt.unpack(buffer, offsets, got_outs)
    assert all(torch.equal(byte_view(a), byte_view(b)) for a, b in zip(got_outs, expected_outs))


@needs_toolchain
def test_op_rejects_bad_arguments(ops_library):
    t = torch.randn(4, 4)
    out = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.ds_pipe_ckpt.pack([t.t()], [0], 0, out)
    with pytest.raises(RuntimeError, match="must not overlap"):
        torch.ops.ds_pipe_ckpt.pack([t, t], [0, 32], 0, out)
    with pytest.raises(RuntimeError, match="needs bytes"):
        torch.ops.ds_pipe_ckpt.unpack(out, [16], [t])
