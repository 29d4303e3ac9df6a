"""`specdec distill`: train a small draft for a target on the target's own soft labels.

Pipeline (every phase resumable):
  1. load the target; label caches for held-out chat prompts, training chat prompts (on-policy
     samples at temperature 1) and offline text (stdlib sources) - top-k laws per position;
  2. build the draft: N decoder layers initialised from target layers (chosen by held-out alpha
     at initialisation unless given), target embedding / final norm / head shared and frozen;
  3. train the layers on forward KL(p_target || q_draft) at temperature 1 over the cache;
     held-out alpha and greedy agreement every `eval_every` steps, checkpoint every
     `checkpoint_every` steps, the artifact rewritten whenever held-out alpha improves.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CACHE_VERSION = 1


@dataclass
class DistillConfig:
    target: str = "smollm2-135m-instruct"
    out: str | None = None  # artifact directory; default drafts/<target short name>-<N>l
    work_dir: str | None = None  # label cache + checkpoint; default .run/distill/<artifact name>
    num_layers: int = 2
    init_layers: list[int] | None = None  # None: pick the best candidate by held-out alpha at init
    chat_sequences: int = 1024
    text_sequences: int = 256
    heldout_sequences: int = 16
    max_new_tokens: int = 192
    text_len: int = 256
    top_k: int = 64
    shard_size: int = 16
    steps: int = 1000
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int = 50
    label_seconds: float | None = None  # stop label generation after this many seconds
    max_seconds: float | None = None  # stop training after this many seconds (this run)
    seed: int = 0
    threads: int | None = None
    device: str = "auto"
    resume: bool = False
    progress: bool = True
    weights_dtype: str = "bfloat16"
    head_tokens: int = 8192  # 0 < N < vocab: the draft head keeps only N tokens (most target mass)
    init_from: str | None = None  # a draft artifact to start from instead of target layers
    # "tokens": a small LM over tokens; "target_hidden": reads the target's hidden states (EAGLE-style)
    conditioning: str = "tokens"
    hidden_loss_weight: float = 0.2  # target_hidden: weight of smooth-L1(draft state, target state)
    extra: dict = field(default_factory=dict)


def default_names(cfg: DistillConfig) -> tuple[Path, Path]:
    from specdec.models.sources import ALIASES, PACKAGED_MODELS

    key = ALIASES.get(cfg.target.lower(), cfg.target.lower())
    short = key if key in PACKAGED_MODELS else Path(cfg.target.rstrip("/")).stem or "target"
    from specdec.models.draft_artifact import CONDITIONING_TARGET_HIDDEN

    name = f"{short}-{cfg.num_layers}l" + ("-hidden" if cfg.conditioning == CONDITIONING_TARGET_HIDDEN else "")
    out = Path(cfg.out) if cfg.out else Path("drafts") / name
    work = Path(cfg.work_dir) if cfg.work_dir else Path(".run") / "distill" / name
    return out, work


# ---------------------------------------------------------------- loss and metrics


def topk_kl(logits: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) per position on the partition {top-k tokens of p} + {everything else}.

    logits: [N, V] draft logits; topk_ids [N, k]; topk_probs [N, k] (the target's top-k law).
    Exact KL of the coarse-grained laws (a lower bound of the full KL that equals it as the
    leftover mass -> 0); the leftover bucket keeps q from piling mass outside p's support.
    Tokens the draft cannot emit (logit -inf: outside a vocabulary-subset head) join the
    leftover bucket, so the loss stays finite.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    logq = logits.gather(-1, topk_ids) - lse
    emittable = torch.isfinite(logq)
    p = torch.where(emittable, topk_probs.float(), 0.0)
    logq = torch.where(emittable, logq, 0.0)
    p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)
    q_rest = (1.0 - torch.where(emittable, logq.exp(), 0.0).sum(-1)).clamp(min=1e-6)
    kl = (p * (p.clamp_min(1e-8).log() - logq)).sum(-1)
    kl = kl + p_rest * (p_rest.clamp_min(1e-8).log() - q_rest.log())
    return kl


def topk_metrics(logits: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor) -> dict[str, float]:
    """Held-out alpha (sum over p's top-k of min(p, q): a lower bound, tight as the leftover -> 0)
    and greedy agreement (argmax q == argmax p) over N positions."""
    q = torch.softmax(logits.float(), dim=-1)
    q_k = q.gather(-1, topk_ids)
    alpha = torch.minimum(q_k, topk_probs.float()).sum(-1)
    greedy = (q.argmax(-1) == topk_ids[:, 0]).float()
    kl = topk_kl(logits, topk_ids, topk_probs)
    return {
        "alpha": float(alpha.mean()),
        "greedy": float(greedy.mean()),
        "kl": float(kl.mean()),
        "positions": int(alpha.numel()),
    }


# ---------------------------------------------------------------- batches


class Batches:
    """Seeded epochs over the rows of the training shards; batch b is a pure function of b."""

    def __init__(self, shards, batch_size: int, seed: int):
        self.shards = shards
        self.items = [(s, r) for s, shard in enumerate(shards) for r in range(shard.tokens.shape[0])]
        self.items = [(s, r) for s, r in self.items if int(shards[s].lengths[r]) - 1 > shards[s].first_label(r)]
        if not self.items:
            raise ValueError("the label cache holds no training rows")
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.items)))
            random.Random(self.seed * 1000 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def batch(self, step: int):
        picks = []
        for j in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, i = divmod(j, len(self.items))
            picks.append(self.items[self._order_for(epoch)[i]])
        return collate([self.shards[s] for s, _ in picks], [r for _, r in picks])


def collate(shards, rows):
    """-> tokens [B, W] long, valid [B, W] bool, topk_ids [B, W, k] long, topk_probs [B, W, k] float,
    hidden [B, W, H] float (the target's hidden states; None unless the shards carry them)."""
    lengths = [int(s.lengths[r]) for s, r in zip(shards, rows)]
    width = max(lengths)
    k = shards[0].topk_ids.shape[-1]
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    ids = torch.zeros(len(rows), width, k, dtype=torch.long)
    probs = torch.zeros(len(rows), width, k, dtype=torch.float32)
    for i, (s, r) in enumerate(zip(shards, rows)):
        n = lengths[i]
        tokens[i, :n] = s.tokens[r, :n].long()
        valid[i, s.first_label(r) : n - 1] = True
        ids[i, : n - 1] = s.topk_ids[r, : n - 1].long()
        probs[i, : n - 1] = s.topk_probs[r, : n - 1].float()
    hidden = None
    if shards[0].hidden is not None:
        hidden = torch.zeros(len(rows), width, shards[0].hidden.shape[-1], dtype=torch.float32)
        for i, (s, r) in enumerate(zip(shards, rows)):
            hidden[i, : lengths[i]] = s.hidden[r, : lengths[i]].float()
    return tokens, valid, ids, probs, hidden


def draft_logits_at(draft, tokens: torch.Tensor, valid: torch.Tensor, target_hidden=None) -> torch.Tensor:
    """Draft logits at the valid positions only: the head runs on no padding.

    [N, V] for a full head; [N, S + 1] for a vocabulary-subset head (its S columns, then a
    -inf column that `label_columns` maps every other token to).
    target_hidden [B, W, H]: the target's states, for a draft that reads them.
    """
    return draft_outputs_at(draft, tokens, valid, target_hidden)[0]


def draft_outputs_at(draft, tokens: torch.Tensor, valid: torch.Tensor, target_hidden=None):
    """(`draft_logits_at`'s logits, the draft's final hidden states [N, H] at the valid positions).

    A draft that reads the target's states is fed, at position t, the target's state at t - 1
    (zeros at 0): the label at t is the law the target computed from its state at t, which the
    draft's own state there learns to match.
    """
    from specdec.models.draft_artifact import VocabSubsetHead, fed_hidden, fused_inputs, needs_target_hidden

    if needs_target_hidden(draft):
        if target_hidden is None:
            raise ValueError("this draft reads the target's hidden states: the label cache has none")
        fed = fed_hidden(target_hidden[:, :-1])
        states = draft.model(inputs_embeds=fused_inputs(draft, tokens, fed), use_cache=False).last_hidden_state
    else:
        states = draft.model(input_ids=tokens, use_cache=False).last_hidden_state
    hidden = states[valid]
    head = draft.get_output_embeddings()
    if isinstance(head, VocabSubsetHead):
        sub = head.subset_logits(hidden)
        return torch.cat([sub, sub.new_full((sub.shape[0], 1), float("-inf"))], dim=-1), hidden
    return head(hidden), hidden


def label_columns(draft, topk_ids: torch.Tensor) -> torch.Tensor:
    """Token ids -> columns of `draft_logits_at`'s output (identity for a full head)."""
    from specdec.models.draft_artifact import VocabSubsetHead

    head = draft.get_output_embeddings()
    return head.column_of[topk_ids] if isinstance(head, VocabSubsetHead) else topk_ids


def choose_head_tokens(shards, size: int, always: list[int], vocab_size: int) -> torch.Tensor:
    """The `size` tokens carrying the most target probability over the cached labels, plus
    `always` (EOS and special tokens: a draft that can never end a sequence wastes rounds)."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for shard in shards:
        for row in range(shard.tokens.shape[0]):
            lo, hi = shard.first_label(row), int(shard.lengths[row]) - 1
            if hi > lo:
                mass.index_add_(0, shard.topk_ids[row, lo:hi].long().flatten(), shard.topk_probs[row, lo:hi].double().flatten())
    forced = sorted({int(t) for t in always if 0 <= int(t) < vocab_size})
    mass[forced] = float("inf")
    size = min(vocab_size, max(size, len(forced)))
    return torch.sort(torch.topk(mass, size).indices).values


@torch.no_grad()
def evaluate(draft, shards, device, batch_size: int = 8, autocast=None) -> dict[str, float]:
    was_training = draft.training
    draft.eval()
    totals = {"alpha": 0.0, "greedy": 0.0, "kl": 0.0, "positions": 0}
    pairs = [(s, r) for s in shards for r in range(s.tokens.shape[0]) if int(s.lengths[r]) - 1 > s.first_label(r)]
    for lo in range(0, len(pairs), batch_size):
        chunk = pairs[lo : lo + batch_size]
        tokens, valid, ids, probs, hidden = collate([s for s, _ in chunk], [r for _, r in chunk])
        tokens, valid = tokens.to(device), valid.to(device)
        hidden = hidden.to(device) if hidden is not None else None
        with autocast():
            logits = draft_logits_at(draft, tokens, valid, hidden)
        m = topk_metrics(logits, label_columns(draft, ids.to(device)[valid]), probs.to(device)[valid])
        totals["alpha"] += m["alpha"] * m["positions"]
        totals["greedy"] += m["greedy"] * m["positions"]
        totals["kl"] += m["kl"] * m["positions"]
        totals["positions"] += m["positions"]
    draft.train(was_training)
    n = max(1, totals["positions"])
    return {
        "alpha": totals["alpha"] / n,
        "greedy": totals["greedy"] / n,
        "kl": totals["kl"] / n,
        "positions": totals["positions"],
    }


def lr_at(step: int, cfg: DistillConfig, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr over `steps` - or over this run's
    `max_seconds`, whichever ends first (a time budget on a busy CPU still ends with a low LR)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, max(time_fraction, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------- the run


def init_candidates(num_layers: int, n_target: int) -> list[list[int]]:
    """Layer choices to try at initialisation: the first N, the first N-1 + last, spread out."""
    first = list(range(num_layers))
    candidates = [first]
    if num_layers < n_target:
        candidates.append(list(range(num_layers - 1)) + [n_target - 1])
        spread = sorted({round(i * (n_target - 1) / max(1, num_layers - 1)) for i in range(num_layers)})
        if len(spread) == num_layers:
            candidates.append(spread)
        candidates.append(list(range(n_target - num_layers, n_target)))
    unique = []
    for c in candidates:
        if c not in unique:
            unique.append(c)
    return unique


def distill(cfg: DistillConfig, log=print) -> dict:
    """Run (or resume) a distillation; returns a summary dict (also in the artifact manifest)."""
    from tqdm.auto import tqdm

    from specdec.distill import data
    from specdec.distill.labels import build_cache, build_hidden_cache, load_shards
    from specdec.models.draft_artifact import (
        CONDITIONING_TARGET_HIDDEN,
        apply_head_subset,
        build_draft,
        freeze_shared,
        head_token_ids,
        load_draft_weights,
        save_draft_artifact,
        trained_state,
    )
    from specdec.models.loading import eos_token_ids, load_causal_lm, resolve_device, resolve_dtype
    from specdec.models.sources import load_tokenizer, tokenizer_fingerprint

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = resolve_device(cfg.device)
    use_cuda = device.type == "cuda"

    def autocast():
        if use_cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    out_dir, work_dir = default_names(cfg)
    work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = work_dir / "labels"
    meta_path = cache_dir / "cache.json"
    cache_meta = {
        "version": CACHE_VERSION,
        "target": cfg.target,
        "top_k": cfg.top_k,
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "text_len": cfg.text_len,
        "shard_size": cfg.shard_size,
    }
    if meta_path.exists() and json.loads(meta_path.read_text()) != cache_meta:
        raise SystemExit(f"{cache_dir} was built with other settings ({meta_path}); remove it or pick --work-dir")
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(cache_meta, indent=2))

    log(f"loading target {cfg.target} on {device}")
    started_load = time.monotonic()
    target, _ = load_causal_lm(cfg.target, dtype="bfloat16" if use_cuda else "float32", device=str(device))
    tokenizer = load_tokenizer(cfg.target)
    fingerprint = tokenizer_fingerprint(tokenizer)
    eos = eos_token_ids(target, tokenizer)
    log(f"target loaded in {time.monotonic() - started_load:.1f}s ({target.config.num_hidden_layers} layers)")

    # ---- 1. labels
    label_started = time.monotonic()
    deadline = label_started + cfg.label_seconds if cfg.label_seconds else None
    common = dict(
        target=target,
        tokenizer=tokenizer,
        shard_size=cfg.shard_size,
        max_new_tokens=cfg.max_new_tokens,
        top_k=min(cfg.top_k, int(target.config.vocab_size)),
        seed=cfg.seed,
        eos_ids=eos,
        progress=cfg.progress,
        log=log,
    )
    build_cache(
        cache_dir, kind="heldout", prompts=data.heldout_prompts(cfg.heldout_sequences),
        sequences=cfg.heldout_sequences, **common,
    )
    # Chat and text shards interleave so a time budget still yields a mix.
    windows = list(data.text_windows(tokenizer, cfg.text_len, cfg.text_sequences, cfg.seed))
    prompts = data.train_prompts(cfg.seed)
    chat_shards = (cfg.chat_sequences + cfg.shard_size - 1) // cfg.shard_size
    text_shards = (len(windows) + cfg.shard_size - 1) // cfg.shard_size
    label_tokens = 0
    for step in range(max(chat_shards, text_shards)):
        for kind, total, n_shards in (("chat", cfg.chat_sequences, chat_shards), ("text", len(windows), text_shards)):
            if step < n_shards:
                label_tokens += build_cache(
                    cache_dir, kind=kind, prompts=prompts, windows=windows,
                    sequences=min(total, (step + 1) * cfg.shard_size), deadline=deadline,
                    **{**common, "progress": False},
                )
        if deadline is not None and time.monotonic() > deadline:
            log("label time budget reached")
            break
    label_seconds = time.monotonic() - label_started
    reads_hidden = cfg.conditioning == CONDITIONING_TARGET_HIDDEN
    if reads_hidden:
        build_hidden_cache(cache_dir, target, progress=cfg.progress, log=log)
    heldout = load_shards(cache_dir, ("heldout",), with_hidden=reads_hidden)
    train_shards = load_shards(cache_dir, ("chat", "text"), with_hidden=reads_hidden)
    n_train_labels = sum(s.label_count for s in train_shards)
    log(
        f"label cache: {n_train_labels} training positions in {len(train_shards)} shards, "
        f"{sum(s.label_count for s in heldout)} held-out; {label_tokens} new this run in {label_seconds:.0f}s"
    )

    # ---- 2. draft
    ckpt_path = work_dir / "checkpoint.pt"
    state = None
    if cfg.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        init_layers = state["init_layers"]
        log(f"resuming from {ckpt_path} at step {state['step']}")
    elif cfg.init_from:
        from specdec.models.draft_artifact import read_manifest

        manifest = read_manifest(cfg.init_from)
        if int(manifest["num_layers"]) != cfg.num_layers:
            raise SystemExit(f"--init-from {cfg.init_from} has {manifest['num_layers']} layers, not {cfg.num_layers}")
        init_layers = [int(i) for i in manifest.get("init_layers") or range(cfg.num_layers)]
    elif cfg.init_layers:
        init_layers = list(cfg.init_layers)
    elif reads_hidden:
        # Its input is (close to) the target's last state: start from the layers that read such states.
        n_target = int(target.config.num_hidden_layers)
        init_layers = list(range(n_target - cfg.num_layers, n_target))
    else:
        best = None
        for cand in init_candidates(cfg.num_layers, int(target.config.num_hidden_layers)):
            trial = build_draft(target, cfg.num_layers, cand).to(device)
            m = evaluate(trial, heldout, device, autocast=autocast)
            log(f"init layers {cand}: held-out alpha {m['alpha']:.3f}, greedy {m['greedy']:.3f}")
            if best is None or m["alpha"] > best[0]:
                best = (m["alpha"], cand)
            del trial
        init_layers = best[1]
    draft = build_draft(target, cfg.num_layers, init_layers, cfg.conditioning)
    if state is None and cfg.init_from:
        load_draft_weights(draft, cfg.init_from)  # also takes the artifact's head subset, if any
        log(f"starting from the layers of {cfg.init_from}")
    # A resumed run keeps its checkpoint's head; an --init-from artifact brought its own.
    head_ids = state.get("head_token_ids") if state is not None else None
    vocab_size = int(target.config.vocab_size)
    if state is None and head_token_ids(draft) is None and 0 < cfg.head_tokens < vocab_size:
        special = list(getattr(tokenizer, "all_special_ids", []) or [])
        head_ids = choose_head_tokens(train_shards, cfg.head_tokens, eos + special, vocab_size)
    if head_ids is not None:
        apply_head_subset(draft, head_ids)
    if head_token_ids(draft) is not None:
        log(f"vocabulary-subset head: {head_token_ids(draft).numel()} tokens")
    draft = draft.to(device)
    freeze_shared(draft)
    target_spec = cfg.target
    del target
    if use_cuda:
        torch.cuda.empty_cache()
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    step, train_seconds, tokens_seen, best_alpha, history = 0, 0.0, 0, -1.0, []
    if state is not None:
        draft.load_state_dict(state["layers"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step, train_seconds = state["step"], state["train_seconds"]
        tokens_seen, best_alpha, history = state["tokens_seen"], state["best_alpha"], state["history"]
        torch.set_rng_state(state["torch_rng"])

    batches = Batches(train_shards, cfg.batch_size, cfg.seed)

    def summary(metrics: dict) -> dict:
        return {
            "target": target_spec,
            "steps": step,
            "train_tokens": tokens_seen,
            "train_seconds": round(train_seconds, 1),
            "label_positions": n_train_labels,
            "heldout_alpha_topk": round(metrics["alpha"], 4),
            "heldout_greedy_agreement": round(metrics["greedy"], 4),
            "heldout_kl": round(metrics.get("kl", float("nan")), 4),
            "heldout_positions": metrics["positions"],
            "init_layers": init_layers,
            "init_from": cfg.init_from,
            "conditioning": cfg.conditioning,
            "head_tokens": None if head_token_ids(draft) is None else int(head_token_ids(draft).numel()),
            "device": str(device),
            "threads": torch.get_num_threads(),
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("extra", "progress")},
            "history": history[-50:],
        }

    def save_checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "step": step,
                "layers": trained_state(draft),
                "optimizer": optimizer.state_dict(),
                "init_layers": init_layers,
                "train_seconds": train_seconds,
                "tokens_seen": tokens_seen,
                "best_alpha": best_alpha,
                "history": history,
                "torch_rng": torch.get_rng_state(),
                "head_token_ids": None if head_token_ids(draft) is None else head_token_ids(draft).cpu(),
            },
            tmp,
        )
        tmp.replace(ckpt_path)

    def eval_and_save() -> dict:
        nonlocal best_alpha
        m = evaluate(draft, heldout, device, autocast=autocast)
        history.append({"step": step, "tokens": tokens_seen, "seconds": round(train_seconds, 1), **m})
        log(
            f"step {step} ({tokens_seen} tokens, {train_seconds:.0f}s): held-out alpha {m['alpha']:.4f}, "
            f"greedy agreement {m['greedy']:.4f}, KL {m['kl']:.4f}"
        )
        if m["alpha"] > best_alpha:
            best_alpha = m["alpha"]
            save_draft_artifact(
                out_dir, draft, target_spec, init_layers, fingerprint,
                weights_dtype=resolve_dtype(cfg.weights_dtype), info=summary(m),
            )
        return m

    # ---- 3. train
    if step == 0:
        eval_and_save()
    draft.train()
    run_started = time.monotonic()
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not cfg.progress)
    last_metrics = history[-1] if history else None
    while step < cfg.steps:
        if cfg.max_seconds is not None and time.monotonic() - run_started > cfg.max_seconds:
            log(f"time budget reached at step {step}")
            break
        t0 = time.monotonic()
        time_fraction = (time.monotonic() - run_started) / cfg.max_seconds if cfg.max_seconds else 0.0
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, time_fraction)
        tokens, valid, ids, probs, hidden = batches.batch(step)
        tokens, valid = tokens.to(device), valid.to(device)
        hidden = hidden.to(device) if hidden is not None else None
        with autocast():
            logits, states = draft_outputs_at(draft, tokens, valid, hidden)
        loss = topk_kl(logits, label_columns(draft, ids.to(device)[valid]), probs.to(device)[valid]).mean()
        if hidden is not None and cfg.hidden_loss_weight:
            # Also match the target's state itself: steps 2..K feed the draft's own state back in.
            loss = loss + cfg.hidden_loss_weight * torch.nn.functional.smooth_l1_loss(states.float(), hidden[valid])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        tokens_seen += int(valid.sum())
        train_seconds += time.monotonic() - t0
        loss_value = float(loss.detach())
        if step % 10 == 0:
            history.append({"step": step, "loss": round(loss_value, 5)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", alpha=f"{best_alpha:.3f}", tok=tokens_seen)
        if step % cfg.eval_every == 0:
            last_metrics = eval_and_save()
        if step % cfg.checkpoint_every == 0:
            save_checkpoint()
    bar.close()
    if not last_metrics or last_metrics.get("step") != step or "alpha" not in last_metrics:
        last_metrics = eval_and_save()
    save_checkpoint()
    result = summary(last_metrics)
    result["best_heldout_alpha_topk"] = round(best_alpha, 4)
    result["artifact"] = str(out_dir)
    result["label_seconds_this_run"] = round(label_seconds, 1)
    (work_dir / "summary.json").write_text(json.dumps(result, indent=2))
    log(
        f"done: {step} steps, {tokens_seen} tokens, {train_seconds:.0f}s training; best held-out alpha "
        f"{best_alpha:.4f}; artifact {out_dir}"
    )
    return result
