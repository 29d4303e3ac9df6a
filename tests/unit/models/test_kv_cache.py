"""ReservedLayer hands attention exactly what DynamicLayer would, without copying the cache per step."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from specdec.models.kv_cache import GROWTH_MIN, ReservedLayer, SharedRoot, new_cache


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=generator), torch.randn(1, 2, n, 4, generator=generator)


def _same(a, b) -> None:
    assert a.keys.shape == b.keys.shape
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_updates_and_crops_match_dynamic_layer():
    reserved, dynamic = ReservedLayer(), DynamicLayer()
    # Prefill, decodes, a rollback after a rejection, a verify, a prefill that outgrows the room.
    script = [("update", 5), ("update", 1), ("update", 1), ("crop", -2), ("update", 4), ("update", 300), ("crop", -7)]
    for seed, (op, n) in enumerate(script):
        if op == "update":
            keys, values = _rows(n, seed)
            got = reserved.update(keys, values)
            want = dynamic.update(keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            reserved.crop(n)
            dynamic.crop(n)
        _same(reserved, dynamic)
        assert reserved.get_seq_length() == dynamic.get_seq_length()


def test_decoding_writes_in_place_and_room_is_bounded():
    layer = ReservedLayer()
    layer.update(*_rows(10, 0))
    buffer = layer._key_buffer
    assert buffer.shape[-2] == 10 + GROWTH_MIN
    for seed in range(GROWTH_MIN):  # fills the room without a new buffer
        layer.update(*_rows(1, seed + 1))
        assert layer._key_buffer is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    layer.update(*_rows(1, 99))  # one more: a new buffer, a quarter larger
    needed = 10 + GROWTH_MIN + 1
    assert layer._key_buffer is not buffer and layer._key_buffer.shape[-2] == needed + max(GROWTH_MIN, needed // 4)


def test_rebound_keys_are_not_overwritten():
    """A method that rebinds keys/values to new tensors (beam search's batch_select_indices) leaves
    the old buffer behind: the next update must start from the rebound tensors."""
    reserved, dynamic = ReservedLayer(), DynamicLayer()
    for layer in (reserved, dynamic):
        layer.update(*_rows(6, 0))
        layer.batch_repeat_interleave(2)
        keys, values = _rows(1, 1)
        layer.update(keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1))
    _same(reserved, dynamic)


def test_deepcopy_is_independent():
    layer = ReservedLayer()
    layer.update(*_rows(4, 0))
    clone = copy.deepcopy(layer)
    clone.update(*_rows(1, 1))
    layer.update(*_rows(1, 2))
    assert not torch.equal(clone.keys[:, :, -1], layer.keys[:, :, -1])
    assert torch.equal(clone.keys[:, :, :4], layer.keys[:, :, :4])


def test_new_cache_reserves_full_attention_layers_only():
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
    )
    kinds = [type(layer) for layer in new_cache(config).layers]
    assert kinds[:2] == [ReservedLayer, ReservedLayer]
    assert all(kind is not ReservedLayer for kind in kinds[2:])


@pytest.mark.parametrize("new", [1, 5])
def test_reset_forgets_the_buffer(new):
    layer = ReservedLayer()
    layer.update(*_rows(3, 0))
    layer.reset()
    keys, values = _rows(new, 1)
    assert torch.equal(layer.update(keys, values)[0], keys)


def test_rows_written_into_the_reserved_buffers_read_as_dynamic_layers_after_extend():
    """The compiled kernels write a step's rows into the buffers (`reserve`), `extend` counts them,
    and the views are made only when read: every later read, crop, reserve or reset sees them."""
    reserved, dynamic = ReservedLayer(), DynamicLayer()
    like = torch.empty(1, 2, 0, 4)
    for seed, (op, n) in enumerate([("write", 5), ("write", 1), ("crop", -2), ("write", 3), ("write", 200)]):
        if op == "crop":
            reserved.crop(n)
            dynamic.crop(n)
        else:
            keys, values = _rows(n, seed)
            length = reserved.own_length()
            reserved.reserve(n, like)  # (may move the counted rows into a larger buffer)
            reserved._key_buffer[:, :, length : length + n] = keys
            reserved._value_buffer[:, :, length : length + n] = values
            reserved.extend(n)
            dynamic.update(keys, values)
            assert reserved.get_seq_length() == dynamic.get_seq_length()
        _same(reserved, dynamic)
    reserved.extend(2)
    reserved.reset()  # with rows counted but never read
    assert reserved.get_seq_length() == 0


def test_a_rollback_is_counted_not_sliced_and_later_rows_land_after_it():
    """A Verify's rollback (`crop` within the own positions) only counts the positions kept, like
    `extend`: no views are made until read, and the next step's rows are written after the kept
    ones, by the kernel's reserve/extend or by update, as DynamicLayer would hold them."""
    reserved, dynamic = ReservedLayer(), DynamicLayer()
    like = torch.empty(1, 2, 0, 4)
    keys, values = _rows(9, 1)
    reserved.update(keys, values)
    dynamic.update(keys, values)
    views = reserved._keys
    reserved.crop(-3)
    dynamic.crop(-3)
    assert reserved._keys is views and reserved.get_seq_length() == 6  # counted, not sliced
    more_k, more_v = _rows(2, 2)
    at = reserved.own_length()
    reserved.reserve(2, like)
    reserved._key_buffer[:, :, at : at + 2], reserved._value_buffer[:, :, at : at + 2] = more_k, more_v
    reserved.extend(2)
    dynamic.update(more_k, more_v)
    reserved.crop(-1)
    dynamic.crop(-1)
    last_k, last_v = _rows(1, 3)
    reserved.update(last_k, last_v)
    dynamic.update(last_k, last_v)
    _same(reserved, dynamic)


def test_a_float16_cache_rounds_what_any_path_writes_and_its_forks_and_copies_stay_float16():
    """A float16 cache (KV_CACHE_DTYPE): `update` (transformers' and SDPA's path), the kernel's
    `reserve` and a fork's or copy's appends all store float16, rounded as torch rounds, so a row
    computed outside the compiled kernel reads the same rounded keys/values as one inside it."""
    from transformers import LlamaConfig

    from specdec.models.kv_cache import copy_cache, fork_cache, storage_dtype

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2)
    cache = new_cache(config, torch.float16)
    keys, values = _rows(40, 7)
    keys, values = keys * 30, values * 30
    for index in range(2):
        got_k, got_v = cache.update(keys, values, index)
        assert got_k.dtype == torch.float16 and torch.equal(got_k, keys.half()) and torch.equal(got_v, values.half())
    layer = cache.layers[0]
    layer.reserve(3, torch.empty(1, 2, 0, 4, dtype=torch.float16))  # the kernel's reservation keeps them
    assert layer._key_buffer.dtype == torch.float16 and torch.equal(layer.keys, keys.half())
    fork, copied = fork_cache(cache, 30, config), copy_cache(cache, 35, config)
    assert storage_dtype(fork) == storage_dtype(copied) == torch.float16
    more_k, more_v = _rows(2, 8)
    fork.layers[0].append(more_k, more_v)  # after a prefix it holds none of: a buffer of its own
    assert fork.layers[0].keys.dtype == torch.float16 and torch.equal(fork.layers[0].keys, more_k.half())
    assert torch.equal(copied.layers[1].keys, keys[:, :, :35].half())
    assert storage_dtype(new_cache(config)) is None  # by default: what the model computes


def _buffers_of(layer: ReservedLayer) -> tuple[int, int, int]:
    return layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr(), layer._key_buffer.shape[-2]


def test_reserve_always_returns_the_current_buffers_addresses_and_room():
    """The kernel writes where `reserve` says: its quick answer for a step after a step must be the
    buffers the layer holds then, through growth, rollbacks, a new dtype, a shared prefix and reset."""
    layer = ReservedLayer()
    like, like16 = torch.empty(1, 2, 0, 4), torch.empty(1, 2, 0, 4, dtype=torch.float16)
    steps = [("reserve", 3), ("reserve", 1), ("reserve", GROWTH_MIN), ("crop", -2), ("reserve", 2)]
    steps += [("half", 1), ("reserve", 1), ("share", 4), ("reserve", 1), ("reset", 0), ("reserve", 2)]
    for op, n in steps:
        if op == "crop":
            layer.crop(n)
        elif op == "share":
            layer.share_first(n, SharedRoot(n))
        elif op == "reset":
            layer.reset()
        else:
            asked = like16 if op == "half" else like
            got = layer.reserve(n, asked)
            assert got == _buffers_of(layer) and layer._key_buffer.dtype == asked.dtype
            assert layer.own_length() + n <= got[2]  # room for the rows the kernel writes
            layer.extend(n)


def test_a_deep_copy_reserves_its_own_buffers_not_the_originals():
    layer, like = ReservedLayer(), torch.empty(1, 2, 0, 4)
    layer.reserve(3, like)
    layer.extend(3)
    clone = copy.deepcopy(layer)
    assert clone.reserve(1, like) == _buffers_of(clone) != _buffers_of(layer)


def test_reserve_refuses_a_batch_of_sequences_even_after_a_step():
    layer = ReservedLayer()
    keys, values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    layer.update(keys, values)
    layer.crop(-1)  # a rollback counted on views of the buffers
    with pytest.raises(ValueError, match="not one sequence"):
        layer.reserve(1, torch.empty(1, 2, 0, 4))
