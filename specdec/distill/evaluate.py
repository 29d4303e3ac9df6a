"""`specdec eval-draft`: how much a draft would pay for a target, measured here.

  alpha   E[sum_x min(p(x), q(x))] over the positions of target samples for held-out chat prompts,
          p and q warped by the project's warp_logits at the given temperature (exact, full vocab)
  greedy  how often argmax q == argmax p at those positions
  c       one cached decode step of the draft / one of the target, through specdec.runner.ModelRunner
          (the code path the model services run), median over `timing_steps` steps
  bound   Leviathan et al.: expected tokens per round (1 - alpha^(K+1)) / (1 - alpha) and
          speedup (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)), for K = 1..max_k
"""

from __future__ import annotations

import statistics
import time
import torch


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per round with K draft tokens (i.i.d. acceptance alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, c: float, k: int) -> float:
    """Walltime improvement over the target alone: tokens per round / cost of a round (cK + 1)."""
    return expected_tokens(alpha, k) / (c * k + 1.0)


def leviathan_table(alpha: float, c: float, max_k: int = 8) -> list[dict]:
    return [
        {"k": k, "tokens_per_round": expected_tokens(alpha, k), "speedup": expected_speedup(alpha, c, k)}
        for k in range(1, max_k + 1)
    ]


def _where(spec: str) -> tuple:
    from specdec.models import resolve_model_source

    source = resolve_model_source(spec)
    return source.location, source.gguf_file


def _load_pair(draft_spec: str, target_spec: str, log):
    from specdec.draft_artifact import artifact_target, load_draft_artifact
    from specdec.models import is_draft_artifact, load_causal_lm, resolve_model_source

    started = time.monotonic()
    target, _ = load_causal_lm(target_spec)
    source = resolve_model_source(draft_spec)
    if is_draft_artifact(source):
        same = _where(artifact_target(source.location)) == _where(target_spec)
        if same:
            draft = load_draft_artifact(source.location, target_model=target)  # reuse the loaded target
        else:
            draft = load_draft_artifact(source.location)
    else:
        draft, _ = load_causal_lm(draft_spec)
    log(f"loaded target and draft in {time.monotonic() - started:.1f}s")
    return draft, target


@torch.inference_mode()
def sample_continuation(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, eos: list[int], seed):
    """Target samples with the project's warping (KV cache, batch 1)."""
    from transformers import DynamicCache

    from specdec.sampling import Sampling, warp_logits

    sampling = Sampling(temperature=temperature)
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    ids = list(prompt_ids)
    logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1:]
    for _ in range(max_new_tokens):
        probs = warp_logits(logits, sampling)[0]
        token = int(torch.multinomial(probs, 1, generator=generator))
        ids.append(token)
        if token in eos:
            break
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1).logits[0]
    return ids


@torch.inference_mode()
def agreement(draft, target, token_ids: list[int], start: int, temperature: float) -> tuple[list[float], list[bool]]:
    """Per position t in [start, len - 1): alpha of the laws for token t + 1, and greedy agreement."""
    from specdec.sampling import Sampling, warp_logits

    x = torch.tensor([token_ids])
    keep = len(token_ids) - start
    lp = target(input_ids=x, logits_to_keep=keep).logits[0, :-1].float()
    lq = draft(input_ids=x, logits_to_keep=keep).logits[0, :-1].float()
    sampling = Sampling(temperature=temperature)
    if sampling.greedy:
        alphas = (lp.argmax(-1) == lq.argmax(-1)).double()
    else:
        alphas = torch.minimum(warp_logits(lp, sampling), warp_logits(lq, sampling)).sum(-1)
    return alphas.tolist(), (lp.argmax(-1) == lq.argmax(-1)).tolist()


def step_seconds(model, prompt_ids: list[int], steps: int) -> list[float]:
    """Seconds per single-token cached decode step through ModelRunner."""
    from specdec.runner import ModelRunner, SessionKVCache

    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=100_000))
    tokens = list(prompt_ids)
    result = runner.last_logits("timing", tokens, 1)
    times = []
    for _ in range(steps + 3):
        tokens.append(int(result.logits[0].argmax()))
        t0 = time.perf_counter()
        result = runner.last_logits("timing", tokens, 1)
        times.append(time.perf_counter() - t0)
    return times[3:]  # the first steps warm up allocators


def eval_draft(
    draft: str,
    target: str,
    prompts: int = 8,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    threads: int | None = None,
    timing_steps: int = 40,
    max_k: int = 8,
    prompt_texts: list[str] | None = None,
    log=print,
) -> dict:
    from specdec.distill.data import chat_token_ids, heldout_prompts
    from specdec.models import eos_token_ids, load_tokenizer, tokenizer_fingerprint

    if threads:
        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(target)
    draft_tokenizer = load_tokenizer(draft)
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(draft_tokenizer):
        raise SystemExit(f"{draft} and {target} do not share a tokenizer: speculative decoding needs one")
    draft_model, target_model = _load_pair(draft, target, log)
    eos = eos_token_ids(target_model, tokenizer)
    texts = prompt_texts or heldout_prompts(prompts)
    alphas: list[float] = []
    greedy: list[bool] = []
    per_prompt = []
    started = time.monotonic()
    for i, text in enumerate(texts):
        prompt_ids = chat_token_ids(tokenizer, text)
        ids = sample_continuation(target_model, prompt_ids, max_new_tokens, temperature or 1.0, eos, seed + i)
        if len(ids) <= len(prompt_ids):
            continue
        a, g = agreement(draft_model, target_model, ids, len(prompt_ids) - 1, temperature)
        alphas += a
        greedy += g
        per_prompt.append({"prompt": text, "positions": len(a), "alpha": sum(a) / len(a)})
        log(f"[{i + 1}/{len(texts)}] alpha {sum(a) / len(a):.3f} over {len(a)} positions: {text}")
    alpha = sum(alphas) / max(1, len(alphas))
    timing_prompt = chat_token_ids(tokenizer, texts[0])
    target_times = step_seconds(target_model, timing_prompt, timing_steps)
    draft_times = step_seconds(draft_model, timing_prompt, timing_steps)
    t_target, t_draft = statistics.median(target_times), statistics.median(draft_times)
    c = t_draft / t_target
    return {
        "draft": draft,
        "target": target,
        "temperature": temperature,
        "positions": len(alphas),
        "alpha": alpha,
        "greedy_agreement": sum(greedy) / max(1, len(greedy)),
        "target_step_ms": 1000 * t_target,
        "draft_step_ms": 1000 * t_draft,
        "c": c,
        "threads": torch.get_num_threads(),
        "eval_seconds": time.monotonic() - started,
        "bound": leviathan_table(alpha, c, max_k),
        "prompts": per_prompt,
    }


def format_report(report: dict) -> str:
    lines = [
        f"draft              {report['draft']}",
        f"target             {report['target']}",
        f"alpha (T={report['temperature']:g})        {report['alpha']:.4f}   over {report['positions']} positions "
        f"of target samples for {len(report['prompts'])} held-out prompts",
        f"greedy agreement   {report['greedy_agreement']:.4f}",
        f"step time          draft {report['draft_step_ms']:.2f} ms, target {report['target_step_ms']:.2f} ms "
        f"({report['threads']} threads)",
        f"c                  {report['c']:.3f}",
        "",
        "Leviathan bound (i.i.d. acceptance):",
        "  K   tokens/round   speedup",
    ]
    for row in report["bound"]:
        lines.append(f"  {row['k']:<3} {row['tokens_per_round']:>12.3f}   {row['speedup']:>7.3f}x")
    return "\n".join(lines)
