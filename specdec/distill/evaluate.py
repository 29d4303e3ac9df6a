"""`specdec eval-draft`: how much a draft would pay for a target, measured here.

alpha   E[sum_x min(p(x), q(x))] over the positions of target samples for held-out chat prompts,
        p and q warped by the project's warp_logits at the given temperature (exact, full vocab)
greedy  how often argmax q == argmax p at those positions
c       one cached decode step of the draft / one of the target, through specdec.models.runner.ModelRunner
        (the code path the model services run), median over `timing_steps` steps
bound   Leviathan et al.: expected tokens per round (1 - alpha^(K+1)) / (1 - alpha) and
        speedup (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)), for K = 1..max_k. For a draft that
        reads the target's hidden states, steps 2..K (fed the draft's own state) have their own
        alpha: tokens per round 1 + a1 + a1 a2 + a1 a2^2 + ...
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from specdec.distill import DistillError


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per round with K draft tokens (i.i.d. acceptance alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, c: float, k: int) -> float:
    """Walltime improvement over the target alone: tokens per round / cost of a round (cK + 1)."""
    return expected_tokens(alpha, k) / (c * k + 1.0)


def expected_tokens_stepwise(alpha_first: float, alpha_later: float, k: int) -> float:
    """Expected tokens per round when the first draft step is accepted with alpha_first and the
    later ones with alpha_later (a hidden-state draft: only its first step reads the target)."""
    total, reach = 1.0, 1.0
    for step in range(k):
        reach *= alpha_first if step == 0 else alpha_later
        total += reach
    return total


def leviathan_table(alpha: float, c: float, max_k: int = 8, alpha_later: float | None = None) -> list[dict]:
    rows = []
    for k in range(1, max_k + 1):
        tokens = expected_tokens(alpha, k) if alpha_later is None else expected_tokens_stepwise(alpha, alpha_later, k)
        rows.append({"k": k, "tokens_per_round": tokens, "speedup": tokens / (c * k + 1.0)})
    return rows


def _where(spec: str) -> tuple:
    from specdec.models.sources import resolve_model_source

    source = resolve_model_source(spec)
    return source.location, source.gguf_file


def _load_pair(draft_spec: str, target_spec: str, log):
    from specdec.models.loading import load_causal_lm, load_draft_artifact
    from specdec.models.sources import artifact_target, is_draft_artifact, resolve_model_source

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

    from specdec.core.sampling import Sampling
    from specdec.models.warping import warp_logits

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
    """Per position t in [start, len - 1): alpha of the laws for token t + 1, and greedy agreement.

    A draft that reads the target's hidden states is run as `hidden_agreement` does (first step).
    """
    from specdec.core.sampling import Sampling
    from specdec.models.draft_artifact import needs_target_hidden
    from specdec.models.warping import warp_logits

    if needs_target_hidden(draft):
        first, greedy, _ = hidden_agreement(draft, target, token_ids, start, temperature)
        return first, greedy

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


@torch.inference_mode()
def hidden_agreement(
    draft, target, token_ids: list[int], start: int, temperature: float
) -> tuple[list[float], list[bool], list[float]]:
    """`agreement` for a draft that reads the target's hidden states, run the way the services do.

    Per position t in [start, len - 1): alpha of the draft's first step (fed the target's states
    up to t - 1), greedy agreement, and alpha of a second step at t + 1, fed the draft's own
    state at t (what the draft does for x_2..x_K, before the target has seen x_1).
    """
    from specdec.core.sampling import Sampling
    from specdec.models.draft_artifact import fed_hidden
    from specdec.models.runner import ModelRunner, SessionKVCache
    from specdec.models.warping import warp_logits

    sampling = Sampling(temperature=temperature)
    x = torch.tensor([token_ids])
    out = target(input_ids=x, output_hidden_states=True)
    lp = out.logits[0].float()
    # float16, as the states travel on the wire.
    states = out.hidden_states[-1][0].to(torch.float16).float()
    fed = fed_hidden(states[:-1])
    runner = ModelRunner(draft, SessionKVCache(max_entries=1, max_tokens=1_000_000))

    def law(logits):
        if sampling.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return warp_logits(logits, sampling)

    first, greedy, second = [], [], []
    for t in range(start, len(token_ids) - 1):
        step = runner.last_logits("eval", token_ids[: t + 1], 1, input_hidden=fed[: t + 1], exact_len=t + 1)
        first.append(float(torch.minimum(law(lp[t : t + 1]), law(step.logits)).sum()))
        greedy.append(bool(lp[t].argmax() == step.logits[0].argmax()))
        if t + 2 < len(token_ids):
            own = torch.cat([fed[: t + 1], step.hidden[-1:]])
            step2 = runner.last_logits("eval", token_ids[: t + 2], 1, input_hidden=own, exact_len=t + 1)
            second.append(float(torch.minimum(law(lp[t + 1 : t + 2]), law(step2.logits)).sum()))
    return first, greedy, second


def step_seconds(model, prompt_ids: list[int], steps: int) -> list[float]:
    """Seconds per single-token cached decode step through ModelRunner."""
    from specdec.models.runner import ModelRunner, SessionKVCache

    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=100_000))
    tokens = list(prompt_ids)

    def step():
        # A hidden-state draft costs the same whatever the states hold.
        fed = torch.zeros((len(tokens), runner.hidden_size)) if runner.needs_target_hidden else None
        return runner.last_logits("timing", tokens, 1, input_hidden=fed)

    result = step()
    times = []
    for _ in range(steps + 3):
        tokens.append(int(result.logits[0].argmax()))
        t0 = time.perf_counter()
        result = step()
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
    """alpha, greedy agreement, c and the Leviathan bound of `draft` for `target` (see the module doc).

    Raises DistillError when the two do not share a tokenizer.
    """
    from specdec.distill.data import chat_token_ids, heldout_prompts
    from specdec.models.sources import load_tokenizer, tokenizer_fingerprint

    if threads:
        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(target)
    draft_tokenizer = load_tokenizer(draft)
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(draft_tokenizer):
        raise DistillError(f"{draft} and {target} do not share a tokenizer: speculative decoding needs one")
    draft_model, target_model = _load_pair(draft, target, log)
    texts = prompt_texts or heldout_prompts(prompts)
    started = time.monotonic()
    found = _agreement_over_prompts(draft_model, target_model, tokenizer, texts, max_new_tokens, temperature, seed, log)
    alphas, greedy, later = found.alphas, found.greedy, found.later
    alpha = sum(alphas) / max(1, len(alphas))
    timing_prompt = chat_token_ids(tokenizer, texts[0])
    target_times = step_seconds(target_model, timing_prompt, timing_steps)
    draft_times = step_seconds(draft_model, timing_prompt, timing_steps)
    t_target, t_draft = statistics.median(target_times), statistics.median(draft_times)
    c = t_draft / t_target
    alpha_later = sum(later) / len(later) if later else None
    return {
        "draft": draft,
        "target": target,
        "temperature": temperature,
        "positions": len(alphas),
        "alpha": alpha,
        "alpha_later_steps": alpha_later,
        "greedy_agreement": sum(greedy) / max(1, len(greedy)),
        "target_step_ms": 1000 * t_target,
        "draft_step_ms": 1000 * t_draft,
        "c": c,
        "threads": torch.get_num_threads(),
        "eval_seconds": time.monotonic() - started,
        "bound": leviathan_table(alpha, c, max_k, alpha_later),
        "prompts": found.per_prompt,
    }


@dataclass
class _Agreement:
    """Per-position results over all prompts."""

    alphas: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    later: list[float] = field(default_factory=list)  # a hidden-state draft's second step
    per_prompt: list[dict] = field(default_factory=list)


def _agreement_over_prompts(
    draft_model, target_model, tokenizer, texts: list[str], max_new_tokens: int, temperature: float, seed: int, log
) -> _Agreement:
    """Sample the target's continuation of each prompt (seed + its index), then score the draft on it."""
    from specdec.distill.data import chat_token_ids
    from specdec.models.draft_artifact import needs_target_hidden
    from specdec.models.loading import eos_token_ids

    eos = eos_token_ids(target_model, tokenizer)
    reads_hidden = needs_target_hidden(draft_model)
    found = _Agreement()
    for i, text in enumerate(texts):
        prompt_ids = chat_token_ids(tokenizer, text)
        ids = sample_continuation(target_model, prompt_ids, max_new_tokens, temperature or 1.0, eos, seed + i)
        if len(ids) <= len(prompt_ids):
            continue
        if reads_hidden:
            a, g, a2 = hidden_agreement(draft_model, target_model, ids, len(prompt_ids) - 1, temperature)
            found.later += a2
        else:
            a, g = agreement(draft_model, target_model, ids, len(prompt_ids) - 1, temperature)
        found.alphas += a
        found.greedy += g
        found.per_prompt.append({"prompt": text, "positions": len(a), "alpha": sum(a) / len(a)})
        log(f"[{i + 1}/{len(texts)}] alpha {sum(a) / len(a):.3f} over {len(a)} positions: {text}")
    return found


def format_report(report: dict) -> str:
    lines = [
        f"draft              {report['draft']}",
        f"target             {report['target']}",
        (
            f"alpha (T={report['temperature']:g})        {report['alpha']:.4f}   over {report['positions']} positions "
            f"of target samples for {len(report['prompts'])} held-out prompts"
        ),
        f"greedy agreement   {report['greedy_agreement']:.4f}",
    ]
    later = report.get("alpha_later_steps")
    if later is not None:
        lines.append(f"alpha, steps 2..K  {later:.4f}   (the draft reads its own state, not the target's)")
    lines += [
        (
            f"step time          draft {report['draft_step_ms']:.2f} ms, target {report['target_step_ms']:.2f} ms "
            f"({report['threads']} threads)"
        ),
        f"c                  {report['c']:.3f}",
        "",
        f"Leviathan bound ({'i.i.d. acceptance' if later is None else 'first step alpha, then alpha of steps 2..K'}):",
        "  K   tokens/round   speedup",
    ]
    for row in report["bound"]:
        lines.append(f"  {row['k']:<3} {row['tokens_per_round']:>12.3f}   {row['speedup']:>7.3f}x")
    return "\n".join(lines)
