"""Smoke test with the default real model: the packaged SmolLM2-135M-Instruct (GGUF).

The draft is the target's first 6 layers + its final norm and head (shared
weights, no second load): a real but poor draft, so greedy rounds reject often.
"""

from __future__ import annotations

import pytest
import torch
from service_stack import start_stack, stop_stack

from specdec.client import build_request
from specdec.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.slow

DEFAULT = "smollm2-135m-instruct"


def _shallow_draft(target_model, num_layers: int):
    from transformers import AutoModelForCausalLM

    config = target_model.config.__class__.from_dict(target_model.config.to_dict())
    config.num_hidden_layers = num_layers
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    draft.model.embed_tokens = target_model.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target_model.model.layers[:num_layers])
    draft.model.norm = target_model.model.norm
    draft.model.rotary_emb = target_model.model.rotary_emb
    draft.lm_head = target_model.lm_head
    return draft.eval()


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8"])
def real_stack(redis_url, request):
    """The stack with the linear products in float32 (the default), in bfloat16 (MATMUL_DTYPE,
    `specdec.models.bf16_matmul`), whose rounding makes any difference in how a position is
    computed visible: without its row-wise attention the first speculative token differed, and in
    int8 (kernels/int8.cpp: every row rounded to 8-bit blocks, the draft's too: it shares the
    target's linears)."""
    from specdec.models import panels
    from specdec.models.bf16_matmul import bf16_supported
    from specdec.models.runner import ModelRunner, SessionKVCache
    from specdec.rpc.model_service import LoadedModel, ModelServerSettings, load_model
    from specdec.settings import load_settings

    if request.param == "bfloat16" and not bf16_supported():
        pytest.skip("this torch build has no oneDNN bfloat16 matmul")
    if request.param == "int8" and not panels.int8_available():
        pytest.skip("no int8 products on this CPU (AVX2)")
    settings = load_settings(ModelServerSettings, [], {}, model=DEFAULT, matmul_dtype=request.param)
    target = load_model(settings, "target")
    draft_model = _shallow_draft(target.runner.model, 6)
    draft_info = type(target.info)()
    draft_info.CopyFrom(target.info)
    draft_info.model_id, draft_info.role = f"{DEFAULT} (first 6 layers)", "draft"
    draft = LoadedModel(ModelRunner(draft_model, SessionKVCache(8, 100_000)), draft_info)
    stack = start_stack({"target": target, "draft": draft}, DEFAULT, redis_url)
    yield stack, target
    stop_stack(stack)


def test_default_pair_greedy_equals_target_only(real_stack):
    stack, target = real_stack
    with stack.channel() as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        prompt = "Write a short poem about the sea."
        greedy = dict(chat=True, max_new_tokens=32, temperature=0, ignore_eos=True)
        speculative = stub.Generate(build_request(prompt, num_speculative_tokens=3, **greedy), timeout=600)
        target_only = stub.Generate(build_request(prompt, num_speculative_tokens=0, **greedy), timeout=600)
    tokens = list(speculative.completions[0].token_ids)
    assert len(tokens) == 32
    assert tokens == list(target_only.completions[0].token_ids)
    assert speculative.completions[0].text.strip()
    stats = speculative.stats
    print(f"real pair: acceptance {stats.acceptance_rate:.3f}, {stats.mean_tokens_per_round:.2f} tokens/round")
    assert stats.recovered_tokens > 0  # the shallow draft disagrees: the residual path ran
    # And both equal Hugging Face's own greedy decoding of the target, wherever Hugging Face agrees
    # with itself: at a near-tie its incremental decode and its forward over the whole sequence can
    # pick different tokens (int8 on an AVX2 EPYC, token 19: its forward's top two 0.02 apart, the
    # decode's token second), and no arithmetic but its own decode's could match both there.
    from specdec.models.sources import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer(rendered, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        # An explicit mask: this model's pad id is its EOS (<|im_end|>), which the chat prompt
        # contains, and generate() would otherwise mask those prompt tokens out.
        reference = target.runner.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )
        forced = target.runner.model(reference).logits[0, ids.shape[1] - 1 : -1].argmax(-1)  # [32]
    decoded = reference[0, ids.shape[1] :]
    agreed = next((i for i in range(len(decoded)) if forced[i] != decoded[i]), len(decoded))
    assert agreed >= 16, agreed  # (Hugging Face's two paths part where the model is near a tie)
    assert tokens[:agreed] == decoded[:agreed].tolist()


def test_the_packaged_targets_decoder_weights_pack_as_4_bit_panels():
    """They are GGUF Q4_1 dequantized, and the head (the embedding's weight) Q8_0: the panels
    kernel then streams a sixth and a third of the bytes for the same products
    (`specdec.models.panels`)."""
    from specdec.models import panels
    from specdec.models.loading import load_causal_lm

    model, _ = load_causal_lm(DEFAULT)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    decoder = [m for name, m in linears if name.startswith("model.layers.")]
    assert len(decoder) == 7 * model.config.num_hidden_layers
    assert all(panels.pack_q4(m.weight) is not None for m in decoder)
    assert panels.pack_q4(model.lm_head.weight) is None and panels.pack_q8(model.lm_head.weight) is not None
