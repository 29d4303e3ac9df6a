"""Tiny random-init causal LMs built from a config, saved as ordinary HF directories.

Small vocabulary, so the target's law over the next few tokens can be enumerated
exactly; the draft is a different random model with sharpened logits, so draft
and target disagree (alpha well below 1) and the residual path is exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = ["<eos>", "a", "b", "c", "d", "e", "f", "g"]
EOS_ID = 0


def save_tokenizer(directory: Path, vocab: list[str] = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(directory)


def as_q4_blocks(weight: torch.Tensor) -> torch.Tensor:
    """The nearest weight that is exactly a GGUF Q4_1 dequantization (w = d * q + m per 32 inputs,
    q in 0..15, d and m float16), as the packaged target's decoder weights are."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // 32, 32)
    m = blocks.amin(-1, keepdim=True).half().float()
    d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((blocks - m) / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 15)
    return (q * d + m).reshape(n, k)


def build_tiny_model(
    directory: Path,
    seed: int,
    logit_scale: float,
    num_layers: int = 2,
    vocab: list[str] = VOCAB,
    q4_blocks: bool = False,
) -> Path:
    """q4_blocks: every linear's weight (the head's too) rounded to exact 4-bit blocks (`as_q4_blocks`)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random init gives near-uniform laws; scaling the head makes them peaked and distinct.
        model.lm_head.weight.mul_(logit_scale)
        for module in model.modules() if q4_blocks else ():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(as_q4_blocks(module.weight))
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(directory, vocab)
    return directory
