"""PagedKV: engine-layout adapters, properties and construction errors."""

from __future__ import annotations

import pytest
import torch

import kvcopy

from helpers.copies import byte_rows, random_tensor


def _shares_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- vLLM


def test_from_vllm_planes_are_k_and_v_views(gen):
    layers = [random_tensor((2, 6, 4, 2, 8), torch.float16, gen) for _ in range(3)]
    kv = kvcopy.PagedKV.from_vllm(layers)
    assert kv.num_planes == 6
    assert kv.num_blocks == 6
    assert kv.device == torch.device("cpu")
    for layer_index, layer in enumerate(layers):
        for half in (0, 1):
            plane = kv.planes[2 * layer_index + half]
            assert plane.shape == (6, 4, 2, 8)
            assert plane.dtype == torch.float16
            assert plane.data_ptr() == layer[half].data_ptr()
            assert plane.stride() == layer[half].stride()
            assert _shares_storage(plane, layer)
            assert torch.equal(byte_rows(plane), byte_rows(layer[half]))
    # A write through a plane is visible in the engine's tensor: no copy was made.
    kv.planes[3][5].fill_(7.0)
    assert torch.all(layers[1][1, 5] == 7.0)
    assert kv.plane_block_nbytes == (4 * 2 * 8 * 2,) * 6
    assert kv.nbytes_per_block == 6 * 4 * 2 * 8 * 2
    assert isinstance(kv.plane_block_nbytes, tuple)


@pytest.mark.parametrize(
    "shape",
    [(3, 6, 4, 2, 8), (1, 6, 4, 2, 8), (2, 6, 4, 2), (2, 6, 4, 2, 8, 1), (6, 2, 4, 2, 8)],
)
def test_from_vllm_rejects_wrong_layer_shape(shape):
    good = torch.zeros(2, 6, 4, 2, 8)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        kvcopy.PagedKV.from_vllm([good, torch.zeros(shape)])


# --------------------------------------------------------------------------- FlashInfer


def test_from_flashinfer_planes_are_strided_views(gen):
    layers = [random_tensor((5, 2, 3, 2, 4), torch.bfloat16, gen) for _ in range(2)]
    kv = kvcopy.PagedKV.from_flashinfer(layers)
    assert kv.num_planes == 4
    assert kv.num_blocks == 5
    block_elems = 3 * 2 * 4
    for layer_index, layer in enumerate(layers):
        for half in (0, 1):
            plane = kv.planes[2 * layer_index + half]
            assert plane.shape == (5, 3, 2, 4)
            # K and V of a block are adjacent: the block stride spans both halves.
            assert plane.stride() == (2 * block_elems, 2 * 4, 4, 1)
            assert plane.data_ptr() == layer[:, half].data_ptr()
            assert plane.data_ptr() == layer.data_ptr() + half * block_elems * layer.element_size()
            assert _shares_storage(plane, layer)
            assert not plane.is_contiguous()
            assert torch.equal(byte_rows(plane), byte_rows(layer[:, half]))
    kv.planes[1][2].fill_(3.0)
    assert torch.all(layers[0][2, 1] == 3.0)
    assert kv.plane_block_nbytes == (block_elems * 2,) * 4
    assert kv.nbytes_per_block == 4 * block_elems * 2


def test_from_flashinfer_write_touches_only_its_half(gen):
    layer = random_tensor((4, 2, 3, 1, 5), torch.float32, gen)
    before = layer.clone()
    kv = kvcopy.PagedKV.from_flashinfer([layer])
    byte_rows(kv.planes[1])[2].fill_(0xAB)
    assert torch.equal(byte_rows(layer[:, 0]), byte_rows(before[:, 0]))
    changed = byte_rows(layer[:, 1])
    assert torch.all(changed[2] == 0xAB)
    assert torch.equal(changed[[0, 1, 3]], byte_rows(before[:, 1])[[0, 1, 3]])


@pytest.mark.parametrize("shape", [(5, 3, 3, 2, 4), (5, 1, 3, 2, 4), (2, 5, 3, 2, 4), (5, 2, 3, 2)])
def test_from_flashinfer_rejects_wrong_layer_shape(shape):
    with pytest.raises(ValueError, match=r"kv_caches\[0\]"):
        kvcopy.PagedKV.from_flashinfer([torch.zeros(shape)])


# --------------------------------------------------------------------------- MLA


def test_from_mla_one_plane_per_layer(gen):
    layers = [random_tensor((7, 3, 11), torch.float8_e4m3fn, gen) for _ in range(3)]
    kv = kvcopy.PagedKV.from_mla(layers)
    assert kv.num_planes == 3
    assert kv.num_blocks == 7
    for plane, layer in zip(kv.planes, layers, strict=True):
        assert plane.data_ptr() == layer.data_ptr()
        assert plane.shape == layer.shape
        assert plane.dtype == torch.float8_e4m3fn
        assert _shares_storage(plane, layer)
    assert kv.plane_block_nbytes == (33, 33, 33)
    assert kv.nbytes_per_block == 99


@pytest.mark.parametrize("shape", [(7, 3), (7, 3, 11, 1), (7,)])
def test_from_mla_rejects_wrong_layer_shape(shape):
    with pytest.raises(ValueError, match=r"kv_caches\[0\]"):
        kvcopy.PagedKV.from_mla([torch.zeros(shape)])


@pytest.mark.parametrize("adapter", ["from_vllm", "from_flashinfer", "from_mla"])
def test_adapters_reject_a_bare_tensor_or_non_tensors(adapter):
    make = getattr(kvcopy.PagedKV, adapter)
    with pytest.raises((TypeError, ValueError)):
        make(torch.zeros(2, 4, 3, 1, 5))
    with pytest.raises((TypeError, ValueError)):
        make([[1, 2, 3]])


@pytest.mark.parametrize("adapter", ["from_vllm", "from_flashinfer", "from_mla"])
def test_adapters_reject_no_layers(adapter):
    with pytest.raises(ValueError):
        getattr(kvcopy.PagedKV, adapter)([])


def test_adapters_reject_layers_with_different_block_counts():
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_vllm([torch.zeros(2, 4, 3, 1, 5), torch.zeros(2, 5, 3, 1, 5)])
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_mla([torch.zeros(4, 3, 5), torch.zeros(6, 3, 5)])


# --------------------------------------------------------------------------- generic planes


def test_from_planes_properties(gen):
    planes = [
        random_tensor((9, 3, 5), torch.bfloat16, gen),
        random_tensor((9, 7), torch.float32, gen),
        random_tensor((9,), torch.uint8, gen),
        random_tensor((9, 2, 2, 2), torch.float8_e4m3fn, gen),
    ]
    kv = kvcopy.PagedKV.from_planes(planes)
    assert kv.num_planes == 4
    assert kv.num_blocks == 9
    assert kv.device == torch.device("cpu")
    assert kv.plane_block_nbytes == (30, 28, 1, 8)
    assert kv.nbytes_per_block == 67
    assert all(p is q or p.data_ptr() == q.data_ptr() for p, q in zip(kv.planes, planes, strict=True))
    assert isinstance(kv.planes, (tuple, list))
    assert len(kv.planes) == kv.num_planes


def test_from_planes_accepts_a_strided_plane_with_contiguous_blocks():
    base = torch.zeros(6, 3, 10)
    plane = base[:, :, 2:7]  # blocks of 3x5 that are NOT contiguous -> rejected
    with pytest.raises(ValueError, match=r"planes\[0\]"):
        kvcopy.PagedKV.from_planes([plane])
    plane = base.view(6, 30)[:, 5:20]  # each block one contiguous run of 15 floats, block stride 30
    kv = kvcopy.PagedKV.from_planes([plane])
    assert kv.plane_block_nbytes == (60,)


def test_from_planes_size_one_dims_may_have_any_stride():
    plane = torch.zeros(4, 8, 1).transpose(1, 2)  # [4, 1, 8], strides (8, 1, 1): each block is contiguous
    kv = kvcopy.PagedKV.from_planes([plane])
    assert kv.plane_block_nbytes == (32,)


def test_transposed_plane_is_rejected():
    plane = torch.zeros(4, 3, 5).transpose(1, 2)
    with pytest.raises(ValueError, match=r"planes\[0\].*contiguous"):
        kvcopy.PagedKV.from_planes([plane])


def test_second_plane_non_contiguous_is_rejected_by_index():
    good = torch.zeros(4, 3, 5)
    bad = torch.zeros(4, 6, 5)[:, ::2]
    with pytest.raises(ValueError, match=r"planes\[1\]"):
        kvcopy.PagedKV.from_planes([good, bad])


def test_transposed_vllm_layer_is_rejected():
    layer = torch.zeros(2, 4, 5, 1, 3).transpose(2, 4)  # [2, 4, 3, 1, 5] with non-contiguous blocks
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_vllm([layer])


def test_overlapping_blocks_are_rejected():
    plane = torch.zeros(1, 3, 5).expand(4, 3, 5)  # block stride 0: every block is the same memory
    with pytest.raises(ValueError, match=r"planes\[0\]"):
        kvcopy.PagedKV.from_planes([plane])


def test_planes_on_different_devices_are_rejected():
    # Two real GPUs are tested in test_gpu.py; the meta device gives a second device on any machine.
    with pytest.raises(ValueError, match=r"planes\[1\].*device"):
        kvcopy.PagedKV.from_planes([torch.zeros(4, 3), torch.zeros(4, 3, device="meta")])


def test_different_block_counts_are_rejected():
    with pytest.raises(ValueError, match=r"planes\[1\]"):
        kvcopy.PagedKV.from_planes([torch.zeros(4, 3), torch.zeros(5, 3)])


def test_no_planes_and_zero_dim_planes_are_rejected():
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_planes([])
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_planes([torch.tensor(1.0)])


def test_non_tensor_plane_is_rejected():
    with pytest.raises(TypeError):
        kvcopy.PagedKV.from_planes([torch.zeros(4, 3), [1, 2, 3]])


def test_planes_per_layer_must_divide_the_plane_count():
    planes = [torch.zeros(4, 3) for _ in range(3)]
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)
    kv = kvcopy.PagedKV.from_planes(planes, planes_per_layer=3)
    assert kv.num_layers == 1


# --------------------------------------------------------------------------- planes over a buffer


@pytest.mark.parametrize("start", [0, 8, 4096])
def test_page_first_planes_place_block_b_plane_p_after_start(gen, start):
    """A staging buffer's layout: block b's planes back to back from ``start + b * nbytes_per_block``."""
    like = kvcopy.PagedKV.from_planes(
        [random_tensor((3, 2, 4), torch.float32, gen), random_tensor((3, 3), torch.float32, gen)], planes_per_layer=2
    )
    num_blocks, npb = 4, like.nbytes_per_block  # 32 + 12 bytes a block
    buffer = torch.zeros(start + num_blocks * npb, dtype=torch.uint8)
    planes = kvcopy.layout.page_first_planes(buffer, like, num_blocks, start=start)
    assert [tuple(p.shape) for p in planes] == [(4, 2, 4), (4, 3)]
    for block in range(num_blocks):
        for index, plane in enumerate(planes):
            plane[block].copy_(random_tensor(tuple(plane.shape[1:]), plane.dtype, gen))
            at = start + block * npb + (0 if index == 0 else 32)
            assert torch.equal(buffer[at : at + like.plane_block_nbytes[index]], byte_rows(plane)[block])
    assert not buffer[:start].any()  # nothing before start was written


def test_a_plane_over_a_buffer_misaligned_for_its_dtype_is_a_value_error():
    like = torch.zeros(2, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"like.planes\[3\].*byte offset 2"):
        kvcopy.layout.plane_over(torch.zeros(64, dtype=torch.uint8), like, 3, 2, 2, 16)


@pytest.mark.parametrize(("offset", "stride"), [(0, 64), (-4, 16), (48, 16)])
def test_a_plane_reaching_outside_its_buffer_is_a_value_error_and_leaves_it_as_it_was(offset, stride):
    buffer = torch.zeros(64, dtype=torch.uint8)
    like = torch.zeros(2, 4, dtype=torch.float32)  # 16-byte blocks
    with pytest.raises(ValueError, match=r"buffer: expected room for like.planes\[1\]'s 2 blocks"):
        kvcopy.layout.plane_over(buffer, like, 1, 2, offset, stride)
    assert buffer.untyped_storage().nbytes() == 64  # set_ would have grown it


@pytest.mark.parametrize("offset", [56, 64])
def test_a_one_block_plane_reaching_outside_its_buffer_is_a_value_error_and_leaves_it_as_it_was(offset):
    """One block has no stride to step by, but it still needs its own bytes: from byte 56 or 64 of a 64-byte
    buffer, a 16-byte block does not fit."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    like = torch.zeros(1, 4, dtype=torch.float32)  # one 16-byte block
    with pytest.raises(ValueError, match=rf"buffer: expected room for like.planes\[0\]'s 1 blocks .* up to byte "
                       rf"{offset + 16}; got 64 bytes"):  # fmt: skip
        kvcopy.layout.plane_over(buffer, like, 0, 1, offset, 16)
    assert buffer.untyped_storage().nbytes() == 64  # set_ would have grown it


def test_a_one_block_plane_ending_at_its_buffers_end_is_its_last_bytes():
    buffer = torch.zeros(64, dtype=torch.uint8)
    like = torch.zeros(1, 4, dtype=torch.float32)
    plane = kvcopy.layout.plane_over(buffer, like, 0, 1, 48, 16)
    plane[0].fill_(1.0)
    assert torch.equal(buffer[48:].view(torch.float32), torch.ones(4)) and not buffer[:48].any()
    assert buffer.untyped_storage().nbytes() == 64
