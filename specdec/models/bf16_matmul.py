"""Forwards with bfloat16 products on CPUs with AMX that still compute each position exactly as a
one-token decode does.

On a CPU with AMX tiles (Intel Sapphire Rapids and later) oneDNN multiplies bfloat16 matrices
several times faster than float32 once there are a few rows; one row costs about the same.
SmolLM2-135M's MLP projection on such a 2-vCPU VM, microseconds: 1 / 8 / 32 / 384 rows 34 / 80 /
260 / 2,092 in float32 against 34 / 37 / 71 / 434 in bfloat16 (casts included). That is what a
batched step, a Verify and a prompt's forward are made of.

What the model then computes: each decoder-layer linear rounds its input and its weights to
bfloat16 (weights once, at load), accumulates in float32 (oneDNN), rounds its output to bfloat16
and returns it as float32; norms, attention, the residual stream and the output head stay float32
(a bfloat16 head would quantise logits to 1/128 of their size).

Why that alone breaks the draft/target law, and the two things that restore it. Rounding to
bfloat16 turns float32 noise into whole bfloat16 steps: a value that one kernel puts just below a
rounding boundary and another just above lands 2^-8 apart, and 30 layers compound it. Measured on
SmolLM2: the same positions run as a 6-row Verify and as six decodes differ in their next-token
laws by a total variation of up to 1.4e-2 (float32: 1.5e-6), and greedy speculative output parted
from K = 0 at its first token. The float32 noise came from two places:
- oneDNN picks its kernel by the number of rows, and kernels accumulate in other orders. On an
  AVX-512 EPYC (avx512_bf16, no AMX) one row is multiplied in another order than 2 or more when
  the inner dimension is 1,536 (SmolLM2's down projection); 2 to 48 rows agree with each other
  there, and on the AMX VM 1 to 32 rows did. So no row runs alone (a lone row goes as the first
  of two, the second zero) and rows run in blocks of at most `block`, checked at load against
  such pairs (`invariant_block` halves it until it holds).
- attention over a multi-row query blocks its keys and masks otherwise than a one-row query does,
  the kernel blocks keys by their count, and on several threads it splits its work by the batch's
  size. So a marked attention module (`ROWWISE`) computes every query row, a decode's included,
  in one form (`exact_rows`): one batch entry of the kernel, its keys padded up to a multiple of
  EXACT_BUCKET positions and masked past its own, on one thread; rows that share a padded length
  go as one call (a 384-token prompt: 12 calls a layer rather than 384 one-row calls).
With both, a Verify's rows and a batch's sessions get the bits of one-token decodes (measured:
logits within 4e-7 of |logit|, the output head's float32 noise, which nothing rounds later). A
prefix stored once (cascade attention) reads the prefix in another order, so runners in this mode
copy forks instead, and uncached sequences run one by one rather than left-padded together.
"""

from __future__ import annotations

import concurrent.futures
import functools

import torch

from specdec.models.cpu_layout import pack_weight, packed_product, packing_available

BLOCK_ROWS = 32  # the largest block tried; oneDNN switched kernels past 32 rows on the AMX VM
ROWWISE = "specdec_rowwise"  # attribute of an attention module whose query rows run one by one


def bf16_supported() -> bool:
    """Whether this torch build multiplies bfloat16 with oneDNN on this CPU (AMX or not)."""
    try:
        return packing_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def amx_available() -> bool:
    """Whether this CPU has AMX tiles, where bfloat16 products pay (without them they need not)."""
    try:
        return bf16_supported() and bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return pack_weight(weight.detach().to(torch.bfloat16))


_product = packed_product  # module-level, so a test can make it depend on the row count


class Bf16Linear(torch.nn.Module):
    """nn.Linear's product in bfloat16 (oneDNN, the weight reordered once), float32 in and out,
    rows in blocks of at most `block` so that each row's bits do not depend on the others."""

    def __init__(self, linear: torch.nn.Linear, block: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block = block
        # An opaque oneDNN tensor replaces the float32 weight (half its memory); not a buffer, so
        # state_dict and .to() never see it.
        self.weight_packed = _pack(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        flat = x.reshape(rows, self.in_features).to(torch.bfloat16)
        if rows <= self.block:
            y = _rows_product(flat, self.weight_packed)
        else:
            y = torch.cat([_rows_product(part, self.weight_packed) for part in flat.split(self.block)])
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _rows_product(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows @ W^T in bfloat16 ([R, in] -> [R, out]); one row as the first of two (the second zero),
    so that it is multiplied by the kernel that multiplies several (see the module's docstring)."""
    if rows.shape[0] == 1:
        return _product(torch.cat([rows, rows.new_zeros(rows.shape)]), packed)[:1]
    return _product(rows, packed)


DRAWS = 4  # random draws per shape and block: a kernel's other order shows only where a rounding flips


def invariant_block(shapes: list[tuple[int, int]], largest: int = BLOCK_ROWS, seed: int = 0) -> int:
    """The largest block (largest, largest / 2, ..., 2) in which, for every weight shape (in, out),
    each of 2..block rows gets the same bits as each row alone (`_rows_product`: in a pair), over
    DRAWS random weights and rows (oneDNN chooses its kernel by shape, not by values, but another
    summation order changes a bfloat16 output only where it lies at a rounding boundary)."""
    generator = torch.Generator().manual_seed(seed)
    block = largest
    while block > 2 and not all(_rows_independent(shape, block, generator) for shape in shapes for _ in range(DRAWS)):
        block //= 2
    return max(block, 2)


def _rows_independent(shape: tuple[int, int], block: int, generator: torch.Generator) -> bool:
    in_features, out_features = shape
    packed = _pack(torch.randn(out_features, in_features, generator=generator))
    x = torch.randn(block, in_features, generator=generator).to(torch.bfloat16)
    alone = torch.cat([_rows_product(x[i : i + 1], packed) for i in range(block)])
    return all(torch.equal(_rows_product(x[:rows], packed), alone[:rows]) for rows in range(2, block + 1))


def decoder_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, name, linear) for every float32 CPU nn.Linear of `model` except those that share a
    weight with an embedding or are its output head (kept float32: tied weights, exact logits)."""
    kept = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        kept.add(id(head.weight))
    found = []
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if (
                type(child) is torch.nn.Linear
                and child is not head
                and id(child.weight) not in kept
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                found.append((parent, name, child))
    return found


def use_bf16_matmuls(model: torch.nn.Module, block: int | None = None, exact: bool = True) -> int:
    """Swap the decoder linears of `model` for Bf16Linear and, if `exact`, mark its attention
    modules ROWWISE (in place); returns the block used (0 when there was nothing to swap). `block`
    None: `invariant_block` over the model's shapes."""
    linears = decoder_linears(model)
    if not linears:
        return 0
    if block is None:
        block = invariant_block(sorted({(c.in_features, c.out_features) for _, _, c in linears}))
    for parent, name, child in linears:
        setattr(parent, name, Bf16Linear(child, block))
    if not exact:
        return block
    for module in model.modules():
        if hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention"):
            setattr(module, ROWWISE, True)
    _route_sdpa_rowwise()
    return block


def use_bf16_forwards(runner, exact: bool = True) -> int:
    """`use_bf16_matmuls` on a runner's model; if `exact`, with the runner's paths that read
    positions in another order than a decode turned off (forks copy; uncached sequences are not
    padded together). Returns the block (0: nothing swapped). A draft needs no exactness: it
    samples from the very law it sends, so it keeps its faster multi-row attention."""
    block = use_bf16_matmuls(runner.model, exact=exact)
    if block and exact:
        runner.stores_prefixes_once = False
        runner.pads_uncached = False
    return block


def rowwise(attend):
    """`attend` (transformers' attention signature) with the query rows of a ROWWISE module
    computed as a decode of each row's position computes it (`exact_rows`). The query rows must be
    the keys' last rows under a plain causal mask (or none: is_causal); any other mask (left
    padding, which exact runners do not make) runs row by row under its own mask rows."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if not getattr(module, ROWWISE, False):
            return attend(module, query, key, value, attention_mask, **kwargs)
        kwargs.pop("is_causal", None)  # one row: nothing to mask but what attention_mask says
        rows, past = query.shape[2], key.shape[2] - query.shape[2]
        if exact_form(module, attention_mask, past, rows):
            jobs = [(query[b : b + 1], key[b : b + 1], value[b : b + 1]) for b in range(len(query))]
            outputs = exact_rows_many(jobs, kwargs.get("scaling"), uses_gqa(module))
            return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), None
        outputs = []
        for i in range(rows):
            mask = attention_mask[:, :, i : i + 1] if attention_mask.shape[2] > 1 else attention_mask
            out, _ = attend(module, query[:, :, i : i + 1], key, value, mask, **kwargs)
            outputs.append(out)  # [B, 1, Hq, D]
        return (outputs[0] if rows == 1 else torch.cat(outputs, dim=1)), None

    return attention


def exact_form(module, mask: torch.Tensor | None, past: int, rows: int) -> bool:
    """Whether `module`'s rows after `past` cached positions, under `mask`, are computed in the
    exact form (`exact_rows`): a ROWWISE module under a plain causal mask or none."""
    return getattr(module, ROWWISE, False) and (mask is None or plain_causal(mask, past, rows))


def uses_gqa(module) -> bool:
    return getattr(module, "num_key_value_groups", 1) > 1


def exact_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale, gqa: bool) -> torch.Tensor:
    """[1, n, Hq, D]: attention of the query rows ([1, Hq, n, D]) at the keys' last n positions
    (key, value: [1, Hkv, past + n, D]), each row computed as a decode of its position computes it.

    The one form of every row: its keys padded up to a multiple of EXACT_BUCKET positions (the
    spare positions of its cache's buffer, else zeros) and masked past its own position, as one
    batch entry of the CPU kernel, run on one thread. Rows that share a padded length go as one
    call. Why each part: the kernel blocks keys by their count (so the count must depend on the
    row's position alone), and on several threads it splits its work by the batch's size, which
    changes a row's sums; on one thread each batch entry is summed alike (measured: every row of
    48- and 384-row calls equal to its one-row call, on 1 thread; not on 2)."""
    return exact_rows_many([(query, key, value)], scale, gqa)[0]


def exact_rows_many(jobs, scale, gqa: bool) -> list[torch.Tensor]:
    """`exact_rows` of every (query, key, value) in `jobs` (a step's sessions), their kernel calls
    shared between this thread and a helper, each call on one thread as that form needs, so the
    calls of a step or a prompt still use two cores."""
    calls, shapes = [], []
    for query, key, value in jobs:
        segment = _calls(query, key, value, scale, gqa)
        calls += segment
        shapes.append(len(segment))
    outputs = _run_calls(calls)
    results, at = [], 0
    for count in shapes:
        part = outputs[at] if count == 1 else torch.cat(outputs[at : at + count])  # [n, Hq, 1, D]
        results.append(part.permute(2, 0, 1, 3))  # [1, n, Hq, D]
        at += count
    return results


def _calls(query, key, value, scale, gqa: bool) -> list[tuple]:
    """The kernel calls of one sequence's rows: (arguments, keyword arguments, cost)."""
    rows = query.shape[2]
    past = key.shape[2] - rows
    width = _bucket(key.shape[2])
    keys, values = _extended(key, width), _extended(value, width)
    calls, start = [], 0
    while start < rows:
        length = _bucket(past + start + 1)
        end = min(rows, length - past)
        batch = end - start
        # [batch, Hq, 1, D]: a row per entry (a decode's one row is that already)
        rows_q = query if rows == 1 else query[0, :, start:end].transpose(0, 1).unsqueeze(2)
        args = (rows_q, keys[:, :, :length].expand(batch, -1, -1, -1), values[:, :, :length].expand(batch, -1, -1, -1))
        kwargs = {"attn_mask": _row_masks(past + start, batch, length, query.dtype), "scale": scale, "enable_gqa": gqa}
        calls.append((args, kwargs, batch * length))
        start = end
    return calls


def _run_calls(calls: list[tuple]) -> list[torch.Tensor]:
    """Each call's output, every call on one thread: the larger ones first, each to whichever of
    this thread and the helper has less work so far (the helper only where this thread runs on
    several and there are several calls)."""
    threads = torch.get_num_threads()
    helper = threads > 1 and len(calls) > 1
    outputs: list[torch.Tensor | None] = [None] * len(calls)
    mine, theirs, load = [], [], [0, 0]
    for index in sorted(range(len(calls)), key=lambda i: -calls[i][2]):
        side = 1 if helper and load[1] < load[0] else 0
        (theirs if side else mine).append(index)
        load[side] += calls[index][2]
    future = _helper().submit(_attend, calls, theirs) if theirs else None
    torch.set_num_threads(1)
    try:
        for index, out in zip(mine, _attend(calls, mine), strict=True):
            outputs[index] = out
    finally:
        torch.set_num_threads(threads)
    if future is not None:
        for index, out in zip(theirs, future.result(), strict=True):
            outputs[index] = out
    return outputs


def _attend(calls: list[tuple], indices: list[int]) -> list[torch.Tensor]:
    return [torch.nn.functional.scaled_dot_product_attention(*calls[i][0], **calls[i][1]) for i in indices]


@functools.cache
def _helper() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that runs a share of the exact attention calls: on one torch thread (set before
    its first torch call, which would take the count another thread set last), so it holds no
    OpenMP team (a second team would throttle the model thread's: `openmp_env`)."""
    from specdec.models.threads import set_torch_threads

    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="exact-attention", initializer=set_torch_threads, initargs=(1,)
    )


EXACT_BUCKET = 32  # a row's keys are padded up to a multiple of this many positions


def _bucket(positions: int) -> int:
    return -(-positions // EXACT_BUCKET) * EXACT_BUCKET


@functools.lru_cache(maxsize=64)
def _row_masks(first: int, rows: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, 1, length] additive: row i (position first + i) sees positions 0..first + i.
    Cached: every layer of a forward asks for the same ones (read only)."""
    hidden = torch.arange(length)[None, :] > (first + torch.arange(rows))[:, None]
    return torch.zeros(rows, length, dtype=dtype).masked_fill_(hidden, float("-inf")).view(rows, 1, 1, length)


def _extended(t: torch.Tensor, positions: int) -> torch.Tensor:
    """t ([1, H, L, D]) over `positions` >= L positions: a view of its own storage where that holds
    them (a cache buffer's spare positions: zeroed, or stale rows, finite either way, which the mask
    hides), else t followed by zeros."""
    if t.shape[2] >= positions:
        return t
    shape = (*t.shape[:2], positions, t.shape[3])
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(shape, t.stride(), strict=True))
    if t.stride(2) >= t.shape[3] and t.stride(3) == 1 and last < t.untyped_storage().nbytes() // t.element_size():
        return t.as_strided(shape, t.stride(), t.storage_offset())
    return torch.cat([t, t.new_zeros((*t.shape[:2], positions - t.shape[2], t.shape[3]))], dim=2)


# (mask, rows, plain) of the last mask seen: every layer of a forward gets the same mask object.
# One tuple, replaced whole, so model threads of other runners never read half of another's.
_last_mask: tuple = (None, 0, False)


def plain_causal(mask: torch.Tensor, past: int, rows: int) -> bool:
    """Whether `mask` ([B, 1, rows, past + rows], bool or additive float) lets query row i see
    exactly keys 0..past + i, for every batch row."""
    global _last_mask
    last = _last_mask
    if mask is last[0] and rows == last[1]:
        return last[2]
    plain = tuple(mask.shape[-2:]) == (rows, past + rows)
    if plain:
        visible = mask if mask.dtype == torch.bool else mask == 0
        expected = torch.ones(rows, past + rows, dtype=torch.bool, device=mask.device).tril(past)
        plain = bool((visible[:, 0] == expected).all())
    _last_mask = (mask, rows, plain)
    return plain


def _route_sdpa_rowwise() -> None:
    """transformers' "sdpa" attention, wrapped by `rowwise` once per process (unmarked modules,
    every other model's, run it unchanged)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], ROWWISE, False):
        wrapped = rowwise(sdpa_attention_forward)
        setattr(wrapped, ROWWISE, True)
        AttentionInterface.register("sdpa", wrapped)
