"""`specdec distill` on a tiny random target: labels, training, artifact, draft service, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("distill") / "target", seed=3, logit_scale=6.0, num_layers=4)


def _config(target, tmp_path, **overrides):
    from specdec.distill.train import DistillConfig

    base = {
        "target": str(target),
        "out": str(tmp_path / "draft"),
        "work_dir": str(tmp_path / "work"),
        "num_layers": 2,
        "chat_sequences": 24,
        "text_sequences": 0,
        "heldout_sequences": 8,
        "max_new_tokens": 20,
        "shard_size": 8,
        "steps": 30,
        "batch_size": 4,
        "lr": 3e-3,
        "warmup_steps": 3,
        "eval_every": 10,
        "checkpoint_every": 10,
        "progress": False,
        "seed": 0,
    }
    base.update(overrides)
    return DistillConfig(**base)


def test_leviathan_bound():
    from specdec.distill.evaluate import expected_speedup, expected_tokens

    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(1.0, 3) == pytest.approx(4.0)
    assert expected_speedup(0.6, 0.2, 2) == pytest.approx((1 - 0.6**3) / 0.4 / 1.4)


def test_topk_kl_is_exact_kl_when_topk_covers_the_vocab():
    from specdec.distill.train import topk_kl

    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5, 8), -1)
    logits = torch.randn(5, 8)
    probs, ids = torch.sort(p, -1, descending=True)
    exact = (p * (p.log() - torch.log_softmax(logits, -1))).sum(-1)
    torch.testing.assert_close(topk_kl(logits, ids, probs), exact, rtol=1e-4, atol=1e-5)
    # Truncated top-k: still finite, non-negative (KL of the coarse-grained laws).
    partial = topk_kl(logits, ids[:, :3], probs[:, :3])
    assert torch.all(partial >= -1e-6) and torch.all(partial <= exact + 1e-5)


def test_distill_trains_writes_a_loadable_artifact_and_resumes(tiny_target, tmp_path):
    from draft_service.proposer import propose
    from draft_service.settings import DraftSettings
    from specdec.core.protocols import DraftRequest
    from specdec.core.sampling import Sampling
    from specdec.distill.train import distill
    from specdec.models.sources import DRAFT_ARTIFACT_MARKER, load_tokenizer, tokenizer_fingerprint
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings

    logs: list[str] = []
    first = distill(_config(tiny_target, tmp_path), log=logs.append)
    assert first["steps"] == 30
    evals = [h for h in first["history"] if "alpha" in h]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    # Training reduces the held-out KL and the training loss, and raises alpha.
    assert evals[-1]["kl"] < 0.8 * evals[0]["kl"]
    assert first["best_heldout_alpha_topk"] > evals[0]["alpha"]
    losses = [h["loss"] for h in first["history"] if "loss" in h]
    assert losses[-1] < losses[0]

    artifact = tmp_path / "draft"
    manifest = json.loads((artifact / DRAFT_ARTIFACT_MARKER).read_text())
    assert manifest["target"] == str(tiny_target) and manifest["num_layers"] == 2
    assert (artifact / "draft_layers.safetensors").stat().st_size < 200_000

    # The draft service loads the artifact like any model and proposes with it.
    loaded = load_model(load_settings(DraftSettings, [], {}, model=str(artifact)), "draft")
    assert loaded.info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(str(tiny_target)))
    assert loaded.runner.model.config.num_hidden_layers == 2
    (proposal,) = propose(loaded.runner, [DraftRequest("s", [1, 2, 3], 3, 7)], Sampling(temperature=1.0))
    assert len(proposal.draft_token_ids) == 3
    assert np.allclose(np.asarray(proposal.draft_probs).sum(-1), 1.0, atol=1e-4)

    # Resume: continues from the step-30 checkpoint instead of starting over.
    labels_before = sorted(p.name for p in (tmp_path / "work" / "labels").glob("*.pt"))
    second = distill(_config(tiny_target, tmp_path, steps=40, resume=True), log=logs.append)
    assert any("resuming" in line and "step 30" in line for line in logs)
    assert second["steps"] == 40
    assert second["train_tokens"] > first["train_tokens"]
    assert [h for h in second["history"] if h.get("step") == 30] == [h for h in first["history"] if h.get("step") == 30]
    assert sorted(p.name for p in (tmp_path / "work" / "labels").glob("*.pt")) == labels_before


def test_eval_draft_on_the_tiny_pair(tiny_target, tmp_path):
    from specdec.distill.evaluate import eval_draft
    from specdec.models.draft_artifact import build_draft, save_draft_artifact
    from specdec.models.loading import load_causal_lm

    target, _ = load_causal_lm(str(tiny_target))
    draft = build_draft(target, 4, [0, 1, 2, 3])  # all target layers: the draft is the target
    save_draft_artifact(tmp_path / "same", draft, str(tiny_target), [0, 1, 2, 3])
    report = eval_draft(
        str(tmp_path / "same"), str(tiny_target), prompts=2, max_new_tokens=8, timing_steps=3, log=lambda _: None
    )
    assert report["alpha"] == pytest.approx(1.0, abs=1e-3)
    assert report["greedy_agreement"] == pytest.approx(1.0)
    assert len(report["bound"]) == 8 and report["c"] > 0


def test_cli_registers_subcommands_with_the_default_target():
    from specdec.cli import build_parser
    from specdec.distill.cli import DEFAULT_MODEL
    from specdec.models.sources import DEFAULT_MODEL as MODELS_DEFAULT

    assert DEFAULT_MODEL == MODELS_DEFAULT
    args = build_parser().parse_args(["distill", "--init-layers", "0,29", "--steps", "5"])
    assert args.target == MODELS_DEFAULT and args.init_layers == [0, 29] and args.steps == 5
    assert args.head_tokens == 8192  # the shipped draft's recipe
    assert callable(args.func)
    args = build_parser().parse_args(["eval-draft", "--draft", "drafts/x"])
    assert args.draft == "drafts/x" and callable(args.func)


def test_topk_kl_puts_tokens_the_draft_cannot_emit_in_the_leftover_bucket():
    from specdec.distill.train import topk_kl

    p = torch.tensor([[0.5, 0.3, 0.2]])
    ids = torch.tensor([[0, 1, 2]])
    logits = torch.tensor([[0.0, 1.0, float("-inf")]])  # token 2 is outside a subset head
    logits.requires_grad_(True)
    kl = topk_kl(logits, ids, p)
    q = torch.softmax(logits.detach(), -1)
    # Coarse-grained: {0}, {1}, {rest}; p_rest = 0.2 and q_rest clamps to its floor (1e-6).
    q0, q1 = float(q[0, 0]), float(q[0, 1])
    expected = 0.5 * np.log(0.5 / q0) + 0.3 * np.log(0.3 / q1) + 0.2 * np.log(0.2 / 1e-6)
    assert float(kl.detach()) == pytest.approx(float(expected), rel=1e-4)
    kl.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_distill_with_a_vocabulary_subset_head(tiny_target, tmp_path):
    from safetensors.torch import load_file

    from draft_service.proposer import propose
    from draft_service.settings import DraftSettings
    from specdec.core.protocols import DraftRequest
    from specdec.core.sampling import Sampling
    from specdec.distill import DistillError
    from specdec.distill.train import distill
    from specdec.models.draft_artifact import HEAD_TOKEN_IDS, head_token_ids
    from specdec.models.sources import DRAFT_ARTIFACT_MARKER
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings

    logs: list[str] = []
    first = distill(_config(tiny_target, tmp_path, head_tokens=5, steps=20), log=logs.append)
    assert first["head_tokens"] == 5
    evals = [h for h in first["history"] if "alpha" in h]
    assert evals[-1]["kl"] < evals[0]["kl"]
    artifact = tmp_path / "draft"
    manifest = json.loads((artifact / DRAFT_ARTIFACT_MARKER).read_text())
    assert manifest["head_tokens"] == 5
    subset = load_file(str(artifact / "draft_layers.safetensors"))[HEAD_TOKEN_IDS].tolist()
    assert len(subset) == 5 and 0 in subset  # EOS is always kept

    loaded = load_model(load_settings(DraftSettings, [], {}, model=str(artifact)), "draft")
    assert head_token_ids(loaded.runner.model).tolist() == subset
    assert loaded.runner.vocab_size == 8  # q still spans the whole vocabulary
    (proposal,) = propose(loaded.runner, [DraftRequest("s", [1, 2, 3], 3, 7)], Sampling(temperature=1.0))
    assert set(proposal.draft_token_ids) <= set(subset)
    outside = [t for t in range(8) if t not in subset]
    assert np.all(np.asarray(proposal.draft_probs)[:, outside] == 0.0)

    # Resume keeps the checkpoint's subset; --init-from starts a new run from the artifact.
    second = distill(_config(tiny_target, tmp_path, head_tokens=5, steps=25, resume=True), log=logs.append)
    assert second["steps"] == 25 and second["head_tokens"] == 5
    third = distill(
        _config(
            tiny_target,
            tmp_path,
            out=str(tmp_path / "again"),
            work_dir=str(tmp_path / "work2"),
            steps=5,
            init_from=str(artifact),
        ),
        log=logs.append,
    )
    assert third["head_tokens"] == 5 and third["init_from"] == str(artifact)
    assert any("starting from the layers of" in line for line in logs)
    # An artifact with another layer count is a settings error, not a crash deep in the weights.
    with pytest.raises(DistillError, match="has 2 layers, not 1"):
        distill(
            _config(
                tiny_target,
                tmp_path,
                out=str(tmp_path / "other"),
                work_dir=str(tmp_path / "work2"),
                num_layers=1,
                init_from=str(artifact),
            ),
            log=logs.append,
        )


def test_distill_a_draft_that_reads_the_target_hidden_states(tiny_target, tmp_path):
    """conditioning=target_hidden: a hidden-state cache, training that lowers the loss, an
    artifact the draft service serves as such, and training and serving feeding it alike."""
    from draft_service.settings import DraftSettings
    from specdec.distill.evaluate import eval_draft, hidden_agreement
    from specdec.distill.labels import hidden_shard_path, load_shards
    from specdec.distill.train import collate, distill, draft_logits_at
    from specdec.models.loading import load_causal_lm, load_draft_artifact
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings

    logs: list[str] = []
    cfg = _config(tiny_target, tmp_path, num_layers=1, conditioning="target_hidden", lr=1e-2)
    first = distill(cfg, log=logs.append)
    evals = [h for h in first["history"] if "alpha" in h]
    assert evals[-1]["kl"] < 0.8 * evals[0]["kl"] and first["best_heldout_alpha_topk"] > evals[0]["alpha"]
    labels = sorted((tmp_path / "work" / "labels").glob("*.pt"))
    assert labels and all(hidden_shard_path(p).exists() for p in labels)

    loaded = load_model(load_settings(DraftSettings, [], {}, model=str(tmp_path / "draft")), "draft")
    assert loaded.info.needs_target_hidden_states and loaded.runner.model.config.num_hidden_layers == 1

    # The training forward and the serving path (ModelRunner, as eval-draft runs it) agree.
    target, _ = load_causal_lm(str(tiny_target))
    draft = load_draft_artifact(tmp_path / "draft", target_model=target)
    shard = load_shards(tmp_path / "work" / "labels", ("heldout",), with_hidden=True)[0]
    tokens, valid, _, _, hidden = collate([shard], [0])
    n = int(shard.lengths[0])
    start = shard.first_label(0)
    with torch.no_grad():
        trained_view = torch.softmax(draft_logits_at(draft, tokens, valid, hidden), -1)
    target_view = torch.softmax(target(input_ids=tokens[:, :n]).logits[0, start : n - 1], -1)
    train_alpha = torch.minimum(trained_view, target_view).sum(-1)
    served_alpha, _, later = hidden_agreement(draft, target, tokens[0, :n].tolist(), start, 1.0)
    torch.testing.assert_close(torch.tensor(served_alpha), train_alpha, rtol=1e-3, atol=1e-3)
    assert len(later) == len(served_alpha) - 1

    report = eval_draft(
        str(tmp_path / "draft"), str(tiny_target), prompts=2, max_new_tokens=8, timing_steps=3, log=lambda _: None
    )
    assert 0 < report["alpha"] <= 1 and report["alpha_later_steps"] is not None and report["c"] > 0

    # Resume keeps the fuse: the step-30 evaluation is reproduced, and training continues.
    second = distill(
        _config(tiny_target, tmp_path, num_layers=1, conditioning="target_hidden", lr=1e-2, steps=40, resume=True),
        log=logs.append,
    )
    assert second["steps"] == 40 and second["conditioning"] == "target_hidden"


def test_a_tokens_draft_continues_as_a_hidden_state_draft_from_where_it_was(tiny_target, tmp_path):
    """--init-from a tokens-only artifact with conditioning=target_hidden: the fuse starts by
    ignoring the states, so step 0 scores exactly what the artifact scored."""
    from specdec.distill.labels import load_shards
    from specdec.distill.train import distill, evaluate
    from specdec.models.draft_artifact import build_draft, save_draft_artifact
    from specdec.models.loading import load_causal_lm

    target, _ = load_causal_lm(str(tiny_target))
    tokens_draft = build_draft(target, 1, [2])
    save_draft_artifact(tmp_path / "tokens", tokens_draft, str(tiny_target), [2], weights_dtype=torch.float32)
    result = distill(
        _config(
            tiny_target,
            tmp_path,
            num_layers=1,
            conditioning="target_hidden",
            init_from=str(tmp_path / "tokens"),
            steps=0,
            head_tokens=0,
        ),
        log=lambda _: None,
    )
    heldout = load_shards(tmp_path / "work" / "labels", ("heldout",))
    before = evaluate(tokens_draft, heldout, torch.device("cpu"), autocast=lambda: torch.autocast("cpu", enabled=False))
    assert result["heldout_alpha_topk"] == pytest.approx(before["alpha"], abs=1e-4)


def test_cli_reports_a_label_cache_built_with_other_settings_as_an_error(tiny_target, tmp_path, capsys):
    from specdec.cli import main
    from specdec.distill import DistillError
    from specdec.distill.train import distill

    labels = tmp_path / "work" / "labels"
    labels.mkdir(parents=True)
    (labels / "cache.json").write_text(json.dumps({"version": 1, "top_k": 3}))
    with pytest.raises(DistillError, match="built with other settings"):
        distill(_config(tiny_target, tmp_path), log=lambda _: None)

    argv = ["distill", "--target", str(tiny_target), "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "built with other settings" in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_the_phases_run_on_their_own(tiny_target, tmp_path):
    """Labels, draft, loop and checkpoint, called one by one as `distill` calls them."""
    from specdec.distill import train as t

    cfg = _config(tiny_target, tmp_path, chat_sequences=8, steps=4, eval_every=2, checkpoint_every=100, head_tokens=0)
    device = torch.device("cpu")
    out_dir, work_dir = t.default_names(cfg)
    work_dir.mkdir(parents=True)
    teacher = t.load_teacher(cfg, device, log=lambda _: None)
    labels = t.build_labels(cfg, t.open_label_cache(cfg, work_dir), teacher, log=lambda _: None)
    assert labels.train_positions > 0 and len(labels.heldout) == 1 and labels.new_tokens > 0

    draft = t.build_student(cfg, teacher, labels.train, [0, 3], None, device, log=lambda _: None)
    params, optimizer = t.make_optimizer(cfg, draft)
    assert params and all(p.requires_grad for p in params)
    assert sum(p.numel() for p in params) < sum(p.numel() for p in draft.parameters())  # shared parts frozen
    state = t.restore(None, draft, optimizer)
    run = t.Run(
        cfg=cfg,
        draft=draft,
        optimizer=optimizer,
        params=params,
        heldout=labels.heldout,
        device=device,
        autocast=t.autocast_for(device),
        out_dir=out_dir,
        checkpoint_path=work_dir / "checkpoint.pt",
        init_layers=[0, 3],
        fingerprint=teacher.fingerprint,
        label_positions=labels.train_positions,
        log=lambda _: None,
    )
    last = t.train_loop(run, state, t.Batches(labels.train, cfg.batch_size, cfg.seed))
    assert state.step == 4 and state.tokens_seen > 0
    assert [h["step"] for h in state.history if "alpha" in h] == [2, 4] and last["alpha"] == state.history[-1]["alpha"]
    assert (out_dir / "draft_layers.safetensors").exists()  # the first evaluation set the best alpha

    # A checkpoint restores the loop's state as it was.
    t.save_checkpoint(run, state)
    again = t.restore(t.load_checkpoint(run.checkpoint_path, True, log=lambda _: None), draft, optimizer)
    assert again == state
    assert t.load_checkpoint(run.checkpoint_path, False, log=lambda _: None) is None
