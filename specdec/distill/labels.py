"""The soft-label cache: the target's next-token laws, computed once, trained on many times.

A full row of the target's law is V floats (49152 for SmolLM2: 192 KB in float32). The cache
keeps the top-k probabilities and their token ids per position (k = 64: 384 bytes), which
carry almost all of the mass; the loss treats the remaining mass as one "other" bucket.

Layout of a cache directory:
    <kind>-<index>.pt   one shard: dict(tokens [N, L] int32 (0-padded), lengths [N] int32,
                        prompt_lengths [N] int32 (0 for text), topk_ids [N, L, k] int32,
                        topk_probs [N, L, k] float16, kind, meta)
Position t of a row holds the law of token t + 1 given tokens[: t + 1]; valid for t < length - 1.
Training and held-out evaluation use the positions t >= prompt_length - 1 (the laws of generated
tokens: a draft is never asked to predict the user's prompt or the chat template).
Shards are deterministic functions of (seed, kind, index), so generation resumes by skipping
shards already on disk.

For a draft that reads the target's hidden states, `hidden/<kind>-<index>.pt` holds the
target's final hidden states over the same tokens ([N, L, H] float16, teacher-forced), built
from the label shards by `build_hidden_cache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Shard:
    tokens: torch.Tensor  # [N, L] int32
    lengths: torch.Tensor  # [N] int32
    topk_ids: torch.Tensor  # [N, L, k] int32
    topk_probs: torch.Tensor  # [N, L, k] float16
    prompt_lengths: torch.Tensor | None = None  # [N] int32; None: every position is a label
    hidden: torch.Tensor | None = None  # [N, L', H] float16 target hidden states (L' >= longest row)

    def first_label(self, row: int) -> int:
        if self.prompt_lengths is None:
            return 0
        return max(0, int(self.prompt_lengths[row]) - 1)

    @property
    def label_count(self) -> int:
        return sum(max(0, int(self.lengths[r]) - 1 - self.first_label(r)) for r in range(self.lengths.numel()))


def shard_path(directory: Path, kind: str, index: int) -> Path:
    return Path(directory) / f"{kind}-{index:05d}.pt"


def save_shard(path: Path, rows: list[tuple], kind: str, meta: dict) -> None:
    """rows: (token ids [n], topk ids [n-1, k], topk probs [n-1, k], prompt length)."""
    width = max(len(r[0]) for r in rows)
    k = rows[0][1].shape[-1]
    tokens = torch.zeros(len(rows), width, dtype=torch.int32)
    lengths = torch.zeros(len(rows), dtype=torch.int32)
    ids = torch.zeros(len(rows), width, k, dtype=torch.int32)
    probs = torch.zeros(len(rows), width, k, dtype=torch.float16)
    prompt_lengths = torch.zeros(len(rows), dtype=torch.int32)
    for i, (tok, top_ids, top_probs, prompt_length) in enumerate(rows):
        n = len(tok)
        prompt_lengths[i] = prompt_length
        tokens[i, :n] = torch.tensor(tok, dtype=torch.int32)
        lengths[i] = n
        ids[i, : n - 1] = top_ids[: n - 1].to(torch.int32)
        probs[i, : n - 1] = top_probs[: n - 1].to(torch.float16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "tokens": tokens,
            "lengths": lengths,
            "prompt_lengths": prompt_lengths,
            "topk_ids": ids,
            "topk_probs": probs,
            "kind": kind,
            "meta": meta,
        },
        tmp,
    )
    tmp.replace(path)


def load_shards(directory: Path, kinds: tuple[str, ...] | None = None, with_hidden: bool = False) -> list[Shard]:
    shards = []
    for path in sorted(Path(directory).glob("*.pt")):
        kind = path.name.rsplit("-", 1)[0]
        if kinds is not None and kind not in kinds:
            continue
        data = torch.load(path, weights_only=True)
        hidden = None
        if with_hidden:
            hidden_path = hidden_shard_path(path)
            if not hidden_path.exists():
                raise FileNotFoundError(f"{hidden_path} is missing: build_hidden_cache first")
            hidden = torch.load(hidden_path, weights_only=True)
        shards.append(
            Shard(
                data["tokens"],
                data["lengths"],
                data["topk_ids"],
                data["topk_probs"],
                data.get("prompt_lengths"),
                hidden,
            )
        )
    return shards


def hidden_shard_path(label_path: Path) -> Path:
    return Path(label_path).parent / "hidden" / Path(label_path).name


@torch.inference_mode()
def build_hidden_cache(directory: Path, target, batch_size: int = 8, progress: bool = True, log=print) -> int:
    """The target's final hidden states for every label shard in `directory` that lacks them.

    Teacher-forced over the cached tokens, right-padded (causal attention: padding never
    reaches earlier positions), stored as float16 - what the wire carries to a draft.
    Returns the token count run now.
    """
    from tqdm.auto import tqdm

    device = next(target.parameters()).device
    paths = [p for p in sorted(Path(directory).glob("*.pt")) if not hidden_shard_path(p).exists()]
    done = 0
    started = time.monotonic()
    for path in tqdm(paths, desc="target hidden states", unit="shard", disable=not progress):
        data = torch.load(path, weights_only=True)
        width = int(data["lengths"].max())
        tokens = data["tokens"][:, :width].long()
        parts = []
        for lo in range(0, tokens.shape[0], batch_size):
            batch = tokens[lo : lo + batch_size].to(device)
            out = target(input_ids=batch, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            parts.append(out.hidden_states[-1].to("cpu", torch.float16))
        destination = hidden_shard_path(path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        tmp = destination.with_suffix(".tmp")
        torch.save(torch.cat(parts), tmp)
        tmp.replace(destination)
        done += int(data["lengths"].sum())
    if paths:
        log(f"target hidden states: {done} tokens in {len(paths)} shards, {time.monotonic() - started:.0f}s")
    return done


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = torch.topk(probs, k, dim=-1)
    return indices, values


@torch.inference_mode()
def chat_rows(
    target, prompts_ids: list[list[int]], max_new_tokens: int, top_k: int, eos_ids: list[int], generator
) -> list[tuple]:
    """Sample continuations from the target at temperature 1 (batched, KV cache), keeping the
    top-k law at every prompt and generated position. Rows end at the first EOS."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    batch = len(prompts_ids)
    width = max(len(p) for p in prompts_ids)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, ids in enumerate(prompts_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    out = target(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        use_cache=True,
    )
    logits = out.logits  # [B, width, V]
    top_ids, top_probs = _topk(logits, top_k)
    rows_ids = [[top_ids[r, width - len(p) :].cpu()] for r, p in enumerate(prompts_ids)]
    rows_probs = [[top_probs[r, width - len(p) :].cpu()] for r, p in enumerate(prompts_ids)]
    tokens = [list(p) for p in prompts_ids]
    last = logits[:, -1].float()
    finished = torch.zeros(batch, dtype=torch.bool)
    eos = torch.tensor(eos_ids or [-1])
    next_pos = positions[:, -1] + 1
    for _ in range(max_new_tokens):
        probs = torch.softmax(last.cpu().double(), dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        for r in range(batch):
            if not finished[r]:
                tokens[r].append(int(sampled[r]))
        finished |= torch.isin(sampled, eos)
        if bool(finished.all()):
            break
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        out = target(
            input_ids=sampled[:, None].to(device),
            attention_mask=mask.to(device),
            position_ids=next_pos[:, None].to(device),
            cache=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
        last = out.logits[:, -1].float()
        step_ids, step_probs = _topk(last, top_k)
        for r in range(batch):
            if not finished[r]:
                rows_ids[r].append(step_ids[r : r + 1].cpu())
                rows_probs[r].append(step_probs[r : r + 1].cpu())
    rows = []
    for r in range(batch):
        ids = torch.cat(rows_ids[r])[: len(tokens[r]) - 1]
        probs = torch.cat(rows_probs[r])[: len(tokens[r]) - 1]
        rows.append((tokens[r], ids, probs, len(prompts_ids[r])))
    return rows


@torch.inference_mode()
def text_rows(target, windows: list[list[int]], top_k: int) -> list[tuple]:
    """Teacher-forced target laws on fixed token windows (offline text)."""
    device = next(target.parameters()).device
    rows = []
    width = max(len(w) for w in windows)
    input_ids = torch.zeros(len(windows), width, dtype=torch.long)
    for i, w in enumerate(windows):
        input_ids[i, : len(w)] = torch.tensor(w)  # right padding: earlier positions are unaffected
    logits = target(input_ids=input_ids.to(device), use_cache=False).logits
    top_ids, top_probs = _topk(logits, top_k)
    for i, w in enumerate(windows):
        rows.append((w, top_ids[i, : len(w) - 1].cpu(), top_probs[i, : len(w) - 1].cpu(), 0))
    return rows


def build_cache(
    directory: Path,
    target,
    tokenizer,
    *,
    kind: str,
    prompts: list[str] | None = None,
    windows: list[list[int]] | None = None,
    sequences: int,
    shard_size: int,
    max_new_tokens: int,
    top_k: int,
    seed: int,
    eos_ids: list[int],
    deadline: float | None = None,
    progress: bool = True,
    log=print,
) -> int:
    """Fill `directory` with `sequences` rows of `kind` ("chat" or "text"); returns labels written now.

    Existing shards are kept (resume). Stops early at `deadline` (time.monotonic()).
    """
    from tqdm.auto import tqdm

    from specdec.distill.data import chat_token_ids

    directory = Path(directory)
    n_shards = (sequences + shard_size - 1) // shard_size
    written = 0
    bar = tqdm(total=n_shards, desc=f"target labels ({kind})", unit="shard", disable=not progress)
    for index in range(n_shards):
        path = shard_path(directory, kind, index)
        if path.exists():
            bar.update(1)
            continue
        if deadline is not None and time.monotonic() > deadline:
            log(f"label budget reached: {index}/{n_shards} {kind} shards")
            break
        lo, hi = index * shard_size, min(sequences, (index + 1) * shard_size)
        started = time.monotonic()
        if kind == "text":
            chunk = (windows or [])[lo:hi]
            if not chunk:
                break
            rows = text_rows(target, chunk, top_k)
        else:
            assert prompts, "chat labels need prompts"
            chunk_prompts = [prompts[i % len(prompts)] for i in range(lo, hi)]
            generator = torch.Generator().manual_seed((seed * 1_000_003 + index * 7919 + 17) % (2**31))
            ids = [chat_token_ids(tokenizer, p) for p in chunk_prompts]
            rows = chat_rows(target, ids, max_new_tokens, top_k, eos_ids, generator)
        labels = sum(len(r[0]) - max(1, r[3]) for r in rows)
        save_shard(path, rows, kind, {"seed": seed, "index": index, "seconds": time.monotonic() - started})
        written += labels
        bar.update(1)
        bar.set_postfix(labels=written, tok_s=f"{labels / (time.monotonic() - started):.0f}")
    bar.close()
    return written
