"""A KV cache that grows in place: transformers' DynamicCache with reserved room per layer.

DynamicLayer appends a step's keys/values with `torch.cat`, copying the whole session's cache
on every forward. On a CPU that copy dominated a batched decode step: 8 sessions of 300 cached
tokens spent 73 of 140 ms in `cat` (SmolLM2-135M, 2 cores), since each of 30 layers x 2 tensors
x 8 sessions was copied whole to add one row. `ReservedLayer` keeps a buffer with spare
positions and writes new rows into it; keys/values are views of its first `length` positions,
so a forward reads exactly what DynamicLayer would hand it (same values, same shape). A rollback
(`crop`) only shortens the view. The buffer grows by a quarter (at least GROWTH_MIN positions)
when full, so the copies left cost O(1) amortised per token, and memory stays within 1.25x of
the cached tokens plus GROWTH_MIN positions per layer.

A shared prefix. Sessions that open alike (a long system prompt, a request's samples) can read
their first positions from one copy: a layer may carry `prefix_keys` / `prefix_values`, views of a
`SharedRoot` that several caches read and none writes, with its own buffer holding the positions
after them (`fork_cache`). The model's own attention reads a layer's keys/values whole, so such a
layer refuses `update`: only ragged attention (`specdec.models.ragged`) reads it, attending to the
prefix and to the layer's own positions separately and merging the two by their log-sum-exps.

float16 caches. A model may store its keys/values as float16 (`set_cache_dtype`, the services'
KV_CACHE_DTYPE): half the memory a cached token takes and half the bytes the compiled attention
reads a step. Such a model's caches are made with that dtype (`new_cache(config, dtype)`, and forks
and copies take their source's): `append` rounds what it writes to it, the compiled kernel's
`reserve` makes its buffers in it, and readers other than that kernel widen what they read, so
every row attends to the same rounded keys/values whichever path computed it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROWTH_MIN = 64  # spare positions allocated at least, per growth


@dataclass(eq=False)
class SharedRoot:
    """The storage of a shared prefix: `length` positions in every layer, alive while a cache reads
    them (the per-layer tensors hang off the layers' views; this marks which views are one copy)."""

    length: int


_CACHE_DTYPE = "_specdec_kv_cache_dtype"


def cache_dtype(model) -> torch.dtype | None:
    """What the model's session caches store (`set_cache_dtype`); None: the dtype its layers compute."""
    return getattr(model, _CACHE_DTYPE, None)


def set_cache_dtype(model, dtype: torch.dtype | None) -> None:
    setattr(model, _CACHE_DTYPE, dtype)


def _capacity(needed: int) -> int:
    return needed + max(GROWTH_MIN, needed // 4)


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values ([batch, kv heads, positions, head dim]) are views of
    buffers with room for more positions, optionally after a shared prefix (`prefix_keys`,
    `prefix_values`: [batch, kv heads, prefix_len, head dim], read only)."""

    prefix_keys: torch.Tensor | None = None
    prefix_values: torch.Tensor | None = None
    prefix_root: SharedRoot | None = None
    # What `append` stores (None: what it is given) where the layer has no buffer yet; a buffer
    # keeps its dtype (only `reserve` makes one of another).
    storage_dtype: torch.dtype | None = None
    # Own positions counted by `extend` whose views are not made yet: a batched step extends every
    # layer of every session (8 sessions: 240 layers, two slicings each, ~1.5 ms of a ~18 ms step),
    # and the next step's kernels read the buffers, not the views. Made when keys/values are read.
    _pending: int | None = None
    _keys: torch.Tensor | None = None
    _values: torch.Tensor | None = None
    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    # (key address, value address, capacity, dtype) of the buffers above as `reserve` last read
    # them: what it returns on every step, checked rather than read again (None: read them).
    _reserved: tuple[int, int, int, torch.dtype] | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        self._settle()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._settle()
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        self._settle()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._settle()
        self._values = value

    def _settle(self) -> None:
        needed, self._pending = self._pending, None
        if needed is not None:
            self._keys = self._key_buffer[:, :, :needed]
            self._values = self._value_buffer[:, :, :needed]

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    def own_length(self) -> int:
        """Positions held in this layer's own buffer (after the prefix)."""
        if self._pending is not None:
            return self._pending
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.prefix_len + self.own_length()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._reserved = None

    def _views_buffers(self) -> bool:
        """Whether keys/values are still prefixes of the buffers (a crop keeps them so; a
        method that rebinds them, such as batch_select_indices, does not)."""
        buffer = self._key_buffer
        if self._pending is not None:  # `extend` counted positions of these very buffers
            return True
        return (
            buffer is not None
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.shape[:2] == buffer.shape[:2]
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )

    def _reserve(self, length: int, needed: int, like: torch.Tensor, like_values: torch.Tensor) -> None:
        """Buffers of like's dtype holding at least `needed` positions, the current first `length`
        copied over (converted, where the dtype changes)."""
        if self._views_buffers() and self._key_buffer.shape[-2] >= needed and self._key_buffer.dtype == like.dtype:
            return
        batch, heads, _, key_dim = like.shape
        capacity = _capacity(needed)
        # Zeroed: exact attention (`bf16_matmul.exact_rows`) reads spare positions, masked, and a
        # masked position must hold a finite number (NaN + -inf is NaN).
        keys = like.new_zeros((batch, heads, capacity, key_dim))
        values = like_values.new_zeros((batch, heads, capacity, like_values.shape[-1]))
        if length:
            keys[:, :, :length].copy_(self.keys)
            values[:, :, :length].copy_(self.values)
        self._key_buffer, self._value_buffer = keys, values
        self._reserved = None  # `reserve` reads the new buffers' addresses

    def reserve(self, rows: int, like: torch.Tensor) -> tuple[int, int, int]:
        """Room for `rows` more own positions, to be written straight into the buffers (the compiled
        attention kernel: `specdec.models.ragged`), then counted by `extend`. like: [1, kv heads, 0,
        head dim] of the dtype the buffers must have (`cache_dtype`). Returns (key buffer
        address, value buffer address, capacity in positions); each buffer is [kv heads, capacity,
        head dim], contiguous."""
        pending, reserved = self._pending, self._reserved
        # A decode's usual case in a few checks (a step reserves every layer of every session: 240
        # calls at 8 sessions): `extend` counted the last step's rows in these very buffers, they
        # have room, and they are still the ones the addresses were read from (a deep copy copies
        # the addresses with new buffers).
        if (
            pending is None
            or reserved is None
            or pending + rows > reserved[2]
            or reserved[3] != like.dtype
            or reserved[0] != self._key_buffer.data_ptr()
            or reserved[1] != self._value_buffer.data_ptr()
        ):
            if not self.is_initialized:
                self.lazy_initialization(like, like)
            length = self.own_length()
            self._reserve(length, length + rows, like, like)
            keys, values = self._key_buffer, self._value_buffer
            if keys.shape[0] != 1:  # (contiguous: only `_reserve` makes buffers, whole)
                raise ValueError(f"a cache buffer of shape {tuple(keys.shape)} is not one sequence")
            reserved = self._reserved = (keys.data_ptr(), values.data_ptr(), keys.shape[-2], keys.dtype)
        return reserved[:3]

    def extend(self, rows: int) -> None:
        """Counts `rows` positions written into the buffers after the own ones (`reserve`)."""
        pending = self._pending  # (own_length's first case, inline: called per layer per session each step)
        self._pending = (self.own_length() if pending is None else pending) + rows  # the views: `_settle`, when read

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.prefix_keys is not None:
            # What this returns would lack the prefix: attention over it would be silently wrong.
            raise RuntimeError("a cache layer after a shared prefix is read by ragged attention only")
        return self.append(key_states, value_states)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new positions after the own ones, in the buffers' dtype where they have one;
        returns the own keys/values (the prefix's are `prefix_keys` / `prefix_values`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.own_length()
        needed = length + key_states.shape[-2]
        dtype = self.storage_dtype if self._key_buffer is None else self._key_buffer.dtype
        if dtype is not None:  # a float16 cache rounds its new rows, whoever writes them
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        self._reserve(length, needed, key_states, value_states)
        self._key_buffer[:, :, length:needed].copy_(key_states)
        self._value_buffer[:, :, length:needed].copy_(value_states)
        self.keys = self._key_buffer[:, :, :needed]
        self.values = self._value_buffer[:, :, :needed]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        keep = self.get_seq_length() + tokens_to_remove  # tokens_to_remove <= 0, as DynamicLayer's
        if tokens_to_remove < 0 and keep >= self.prefix_len and self._key_buffer is not None and self._views_buffers():
            # A rollback after rejected drafts, within the own positions of views of the buffers: the
            # shorter views are made when read (a batched Verify's sessions x 30 layers of slicing
            # cost ~0.25 ms a session), as `extend` leaves them.
            self._pending = keep - self.prefix_len
            return
        if tokens_to_remove > 0 or keep >= self.prefix_len:
            super().crop(tokens_to_remove)  # within the own positions (or refused, as DynamicLayer does)
            return
        # Back into the prefix: the first `keep` positions become this layer's own again.
        keys, values = self.prefix_keys[:, :, :keep], self.prefix_values[:, :, :keep]
        self.drop_prefix()
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
        self.append(keys, values)

    def share_first(self, n: int, root: SharedRoot) -> None:
        """Moves this layer's first n own positions (it has no prefix) into a prefix of `root`,
        copied once, and its other positions into a buffer of their own."""
        keys, values = self.keys, self.values
        self.prefix_keys, self.prefix_values = keys[:, :, :n].clone(), values[:, :, :n].clone()
        self.prefix_root = root
        self._key_buffer = self._value_buffer = self._reserved = None
        self.keys, self.values = keys[:, :, :0].clone(), values[:, :, :0].clone()  # not views: the old buffer goes
        if keys.shape[-2] > n:
            self.append(keys[:, :, n:], values[:, :, n:])

    def drop_prefix(self) -> None:
        self.prefix_keys = self.prefix_values = self.prefix_root = None

    def reset(self) -> None:
        self._pending = None
        self._key_buffer = self._value_buffer = self._reserved = None
        self.drop_prefix()
        super().reset()


def new_cache(config, dtype: torch.dtype | None = None) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are ReservedLayers storing `dtype`
    (None: what the model computes; sliding-window and other layer kinds stay as transformers
    makes them)."""
    cache = DynamicCache()  # layers set below, as DynamicCache(config=) would, without reading the config again
    cache.layers = [make() for make in _layer_makers(config)]
    cache.layer_class_to_replicate = None
    if dtype is not None:
        for layer in cache.layers:
            if isinstance(layer, ReservedLayer):
                layer.storage_dtype = dtype
    return cache


_LAYER_MAKERS: dict[int, tuple[object, list]] = {}  # id(config) -> (config, per layer: a maker of an empty one)


def _layer_makers(config) -> list:
    """How each layer of `config`'s caches is made, read from the config once: transformers reads
    it through slow attribute hooks on every DynamicCache(config=), a fifth of the step time of a
    request with thousands of samples, each a new session."""
    known = _LAYER_MAKERS.get(id(config))
    if known is None or known[0] is not config:
        empty = DynamicCache(config=config).layers
        makers = [ReservedLayer if type(layer) is DynamicLayer else partial(copy.deepcopy, layer) for layer in empty]
        known = _LAYER_MAKERS[id(config)] = (config, makers)
    return known[1]


def shareable(cache) -> bool:
    """Whether `fork_cache` can read this cache (every layer a ReservedLayer)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, ReservedLayer) for layer in layers)


def storage_dtype(cache) -> torch.dtype | None:
    """The dtype a cache's ReservedLayers were made to store (`new_cache`), or None."""
    return next((layer.storage_dtype for layer in cache.layers if isinstance(layer, ReservedLayer)), None)


def shared_prefix(cache) -> tuple[SharedRoot | None, int]:
    """(the root the cache's prefix views, its prefix length), or (None, 0)."""
    layers = getattr(cache, "layers", None)
    first = layers[0] if layers else None
    if not isinstance(first, ReservedLayer) or first.prefix_root is None:
        return None, 0
    return first.prefix_root, first.prefix_len


def fork_cache(source: DynamicCache, n: int, config) -> DynamicCache:
    """A new cache of the source's first n positions (a `shareable` source of at least n) that
    stores none of them a second time: the source's shared prefix is read, not copied, and a
    source without one first moves its first n positions into one (a copy, once). Only positions
    past the source's prefix (a fork of a fork that ran further) are copied."""
    if shared_prefix(source)[0] is None:
        root = SharedRoot(n)
        for layer in source.layers:
            layer.share_first(n, root)
    cache = new_cache(config, storage_dtype(source))
    for src, dst in zip(source.layers, cache.layers, strict=True):
        shared = min(n, src.prefix_len)
        dst.prefix_keys = src.prefix_keys[:, :, :shared]
        dst.prefix_values = src.prefix_values[:, :, :shared]
        dst.prefix_root = src.prefix_root
        if n > shared:
            dst.append(src.keys[:, :, : n - shared], src.values[:, :, : n - shared])
    return cache


def copy_cache(source: DynamicCache, n: int, config) -> DynamicCache:
    """A new cache holding copies of a `shareable` source's keys/values of positions [0, n) only (a
    long source is not copied whole for a short shared prefix), its prefix's included."""
    cache = new_cache(config, storage_dtype(source))
    for index, layer in enumerate(source.layers):  # keys/values: [batch, kv heads, positions, head dim]
        shared = min(n, layer.prefix_len)
        if shared:
            cache.update(layer.prefix_keys[:, :, :shared], layer.prefix_values[:, :, :shared], index)
        if n > shared:  # update copies them
            cache.update(layer.keys[:, :, : n - shared], layer.values[:, :, : n - shared], index)
    return cache
