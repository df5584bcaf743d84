"""Strict loading and the pooled forward (kembed.engine.model), checked against sentence-transformers."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from kembed.config.settings import Settings
from kembed.config.values import Graphs
from kembed.domain.inputs import Sequences
from kembed.engine.model import BUNDLED_MODEL_ID, EmbeddingModel, ModelLoadError, resolve_model_path
from kembed.engine.precision import MIN_COSINE, PROBE_TEXTS
from kembed.frontend.service import postprocess

PARAGRAPH = " ".join(
    f"Sentence {i} of a long paragraph talks about embedding servers, token buckets and padding waste."
    for i in range(20)
)  # ~360 tokens: past the model's 256
TEXTS = [
    "hello",
    "Embeddings",
    "",
    " ",
    "   lots   of    repeated     whitespace   \n\n\t  here  ",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "How do I reset my password?",
    "What is the capital of France? Paris is the capital and most populous city of France.",
    "Kubernetes operators reconcile desired state with observed state.",
    "gRPC uses HTTP/2 for transport and protocol buffers for serialization.",
    "naïve café résumé coöperate façade",
    "Größenwahn und Straßenbahn",
    "Москва — столица России.",
    "東京は日本の首都です。",
    "北京欢迎你",
    "서울은 한국의 수도입니다.",
    "مرحبا بالعالم",
    "I love pizza 🍕🍕🍕 and tacos 🌮!",
    "👍👍👍",
    "∑_{i=1}^{n} x_i² ≈ ∫ f(x) dx",
    "def add(a: int, b: int) -> int:\n    return a + b",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "https://example.com/path?query=1&other=two#frag",
    "user@example.com called +1 (555) 010-9999 at 10:45pm",
    "ALL CAPS SHOUTING TEXT",
    "mIxEd CaSe TeXt",
    "[CLS] [SEP] [MASK] literal special tokens",
    "a " * 100,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    PARAGRAPH,
]


def settings(**overrides: Any) -> Settings:
    """Settings from these values only (the process environment is ignored)."""
    return Settings.from_env({}, **overrides)


def padded(seqs: Sequences, pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to one length, as the worker does: pad id and mask 0 after each sequence."""
    length = length or int(seqs.lengths.max())
    ids = np.full((seqs.count, length), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, (start, n) in enumerate(zip(seqs.offsets, seqs.lengths, strict=True)):
        ids[row, :n] = seqs.ids[start : start + n]
        mask[row, :n] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def pooled(model: EmbeddingModel, texts: list[str], length: int | None = None) -> np.ndarray:
    """Raw pooled rows for texts, batched and padded to `length` (default: the longest)."""
    ids, mask = padded(model.tokenizer.from_texts(texts, truncate=True), model.info.pad_token_id, length)
    with torch.inference_mode():
        return model.forward(ids.to(model.info.device), mask.to(model.info.device)).float().cpu().numpy()


def embed(model: EmbeddingModel, texts: list[str]) -> np.ndarray:
    return postprocess(pooled(model, texts), 0, normalize=True)


def worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def model_copy(src: Path, dst: Path, rewritten: Iterable[str] = ()) -> Path:
    """A model folder of symlinks to `src`, except the `rewritten` files the test writes itself."""
    skip = set(rewritten)
    for file in src.rglob("*"):
        relative = file.relative_to(src)
        if file.is_file() and str(relative) not in skip:
            (dst / relative).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(file, dst / relative)
    return dst


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def st_pooling_config(**modes: bool) -> dict[str, Any]:
    return {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": False, **modes}


# --- correctness ------------------------------------------------------------------------------


def test_info(stock_model: EmbeddingModel, bundled_path: Path) -> None:
    info = stock_model.info
    assert (info.model_id, info.path) == (BUNDLED_MODEL_ID, bundled_path)
    assert (info.dimensions, info.max_input_tokens, info.vocab_size, info.pad_token_id) == (384, 256, 30522, 0)
    assert (info.pooling, info.excluded_token_ids) == ("mean", ())
    assert (info.dtype, info.device) == (torch.float32, torch.device("cpu"))
    assert len(info.tokenizer_fingerprint) == 64


@pytest.mark.parametrize(("asked", "expected"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_info_reports_the_dtype_the_weights_were_loaded_in(asked: str, expected: torch.dtype) -> None:
    model = EmbeddingModel.load(settings(dtype=asked))
    assert model.info.dtype == expected
    assert {parameter.dtype for parameter in model._model.parameters()} == {expected}


def test_info_follows_the_weights_when_the_loader_ignores_the_dtype_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers before 4.56 took no ``dtype=`` and loaded float32 whatever was asked."""
    from_pretrained = AutoModel.from_pretrained

    def without_dtype(*args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoModel, "from_pretrained", without_dtype)
    model = EmbeddingModel.load(settings(dtype="bfloat16"))
    assert model.info.dtype == torch.float32
    assert any("asked for torch.bfloat16 weights, loaded torch.float32" in r.getMessage() for r in caplog.records)


def test_the_version_floors_cover_what_the_code_calls() -> None:
    """pip installs the lowest version a floor allows: each floor must have what the server uses."""
    used = {
        "transformers": ("4.56", "from_pretrained(dtype=...)"),
        "tokenizers": ("0.20", "Tokenizer.encode_batch_fast"),
    }
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    floors = dict(
        requirement.split(">=", 1)
        for requirement in pyproject["project"]["optional-dependencies"]["server"]
        if ">=" in requirement
    )
    for package, (needed, why) in used.items():
        assert Version(floors[package]) >= Version(needed), f"{package}>={floors[package]} lacks {why}"


def test_matches_sentence_transformers(stock_model: EmbeddingModel, st_model: Any) -> None:
    ours = embed(stock_model, TEXTS)
    reference = st_model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    cosines = (ours * reference).sum(axis=1)
    print(f"worst cosine vs sentence-transformers: {cosines.min():.7f} ({TEXTS[int(cosines.argmin())][:40]!r})")
    assert cosines.min() >= 0.9999, {TEXTS[i][:40]: float(c) for i, c in enumerate(cosines) if c < 0.9999}
    assert stock_model.tokenizer.from_texts([PARAGRAPH], truncate=True).lengths.tolist() == [256]


def test_padding_does_not_change_vectors(stock_model: EmbeddingModel) -> None:
    texts = TEXTS[5:13]
    tight = pooled(stock_model, texts)
    loose = pooled(stock_model, texts, length=256)
    alone = np.concatenate([pooled(stock_model, [text]) for text in texts])
    np.testing.assert_allclose(loose, tight, atol=1e-5)
    np.testing.assert_allclose(alone, tight, atol=1e-5)


def test_bf16_weights_match_sentence_transformers_fp32_on_a_varied_set(st_model: Any) -> None:
    """What ``KEMBED_DTYPE=auto`` may serve on a CPU with bf16 units: its vectors against the fp32
    reference, on these texts and the warmup's own probe texts (bf16 computes on any x86 CPU)."""
    bf16 = EmbeddingModel.load(settings(dtype="bfloat16"))
    assert bf16.info.dtype == torch.bfloat16
    texts = TEXTS + list(PROBE_TEXTS)
    reference = st_model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    cosines = (embed(bf16, texts) * reference).sum(axis=1)
    print(f"worst cosine, bf16 vs sentence-transformers fp32: {cosines.min():.6f}")
    assert cosines.min() >= MIN_COSINE, {texts[i][:40]: float(c) for i, c in enumerate(cosines) if c < MIN_COSINE}


# --- strict loading -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "add"),
    [
        ("encoder.layer.3.attention.self.query.weight", None),  # missing: would be left random
        (None, "encoder.layer.6.output.dense.weight"),  # unexpected: a deeper checkpoint than the config
    ],
)
def test_mismatched_checkpoint_refuses_to_load(
    bundled_path: Path, tmp_path: Path, drop: str | None, add: str | None
) -> None:
    folder = model_copy(bundled_path, tmp_path, rewritten=["model.safetensors"])
    tensors = load_file(bundled_path / "model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(384, 1536)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{'missing' if drop else 'unexpected'}_keys {drop or add}"):
        EmbeddingModel.load(settings(model=str(folder)))


# --- pooling configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "mode"),
    [
        (st_pooling_config(pooling_mode_cls_token=True), "cls"),  # the legacy format, as all-MiniLM ships it
        ({"embedding_dimension": 384, "pooling_mode": "lasttoken", "include_prompt": True}, "last"),
    ],
)
def test_pooling_from_the_model_folder(bundled_path: Path, tmp_path: Path, config: dict[str, Any], mode: str) -> None:
    from sentence_transformers import SentenceTransformer

    folder = model_copy(bundled_path, tmp_path, rewritten=["1_Pooling/config.json"])
    write_json(folder / "1_Pooling/config.json", config)
    model = EmbeddingModel.load(settings(model=str(folder)))
    assert (model.info.pooling, model.info.model_id) == (mode, tmp_path.name)
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS[:8], normalize_embeddings=True)
    assert worst_cosine(embed(model, TEXTS[:8]), reference) >= 0.9999


def test_settings_override_the_model_folder(bundled_path: Path, tmp_path: Path, st_model: Any) -> None:
    folder = model_copy(bundled_path, tmp_path, rewritten=["1_Pooling/config.json"])
    write_json(folder / "1_Pooling/config.json", st_pooling_config(pooling_mode_cls_token=True))
    model = EmbeddingModel.load(settings(model=str(folder), pooling="mean", max_input_tokens=128))
    assert (model.info.pooling, model.info.max_input_tokens) == ("mean", 128)
    reference = st_model.encode(TEXTS[:8], normalize_embeddings=True)
    assert worst_cosine(embed(model, TEXTS[:8]), reference) >= 0.9999


@pytest.mark.parametrize(
    ("config", "modules", "match"),
    [
        ({"pooling_mode": "max"}, None, r"pooling \['max'\].*KEMBED_POOLING"),
        (st_pooling_config(pooling_mode_mean_tokens=True, pooling_mode_max_tokens=True), None, "pooling"),
        (
            st_pooling_config(pooling_mode_mean_tokens=True),
            {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
            "does not apply sentence_transformers.models.Dense",
        ),
    ],
)
def test_unsupported_sentence_transformers_config_refuses_to_load(
    bundled_path: Path, tmp_path: Path, config: dict[str, Any], modules: dict[str, Any] | None, match: str
) -> None:
    folder = model_copy(bundled_path, tmp_path, rewritten=["1_Pooling/config.json", "modules.json"])
    write_json(folder / "1_Pooling/config.json", config)
    stock_modules = json.loads((bundled_path / "modules.json").read_text())
    write_json(folder / "modules.json", stock_modules + ([modules] if modules else []))
    with pytest.raises(ModelLoadError, match=match):
        EmbeddingModel.load(settings(model=str(folder)))


def test_max_input_tokens_beyond_positions_refuses_to_load() -> None:
    with pytest.raises(ModelLoadError, match="KEMBED_MAX_INPUT_TOKENS=600 exceeds the model's 512"):
        EmbeddingModel.load(settings(max_input_tokens=600))


# --- control tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["[query]", "[UNK]"])
def test_control_token_must_be_one_known_token(token: str) -> None:
    with pytest.raises(ModelLoadError, match=rf"KEMBED_CONTROL_TOKENS: '\[{token[1:-1]}\]' is not a single token"):
        EmbeddingModel.load(settings(control_tokens=[token]))


def tokenizer_with_query_token(src: Path, dst: Path) -> Path:
    """`[unused0]` (id 1) renamed `[query]` and registered as a special token: same ids, same weights."""
    folder = model_copy(src, dst, rewritten=["tokenizer.json", "vocab.txt"])
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {("[query]" if k == "[unused0]" else k): v for k, v in spec["model"]["vocab"].items()}
    spec["added_tokens"].append(
        {"id": 1, "content": "[query]", "special": True, "normalized": False}
        | {"single_word": False, "lstrip": False, "rstrip": False}
    )
    write_json(folder / "tokenizer.json", spec)
    (folder / "vocab.txt").write_text((src / "vocab.txt").read_text().replace("[unused0]\n", "[query]\n", 1))
    return folder


def test_control_tokens_are_left_out_of_mean_pooling(
    bundled_path: Path, tmp_path: Path, stock_model: EmbeddingModel
) -> None:
    folder = tokenizer_with_query_token(bundled_path, tmp_path)
    model = EmbeddingModel.load(settings(model=str(folder), control_tokens=["[query]"]))
    assert model.info.excluded_token_ids == (1,)
    assert model.info.tokenizer_fingerprint != stock_model.info.tokenizer_fingerprint
    seqs = model.tokenizer.from_texts(["[query] hello"], truncate=False)
    assert seqs.ids.tolist() == [101, 1, 7592, 102]

    reference_model = AutoModel.from_pretrained(bundled_path).eval()
    with torch.inference_mode():
        hidden = reference_model(input_ids=torch.tensor([[101, 1, 7592, 102]])).last_hidden_state[0]
    without_control = hidden[[0, 2, 3]].mean(dim=0).numpy()
    everything = hidden.mean(dim=0).numpy()

    got = pooled(model, ["[query] hello"])[0]
    np.testing.assert_allclose(got, without_control, atol=1e-5)
    assert np.abs(got - everything).max() > 1e-2


# --- model resolution ---------------------------------------------------------------------------


def test_resolves_bundled_and_local_folders(bundled_path: Path) -> None:
    model_id, path = resolve_model_path(settings())
    assert model_id == BUNDLED_MODEL_ID
    assert (path / "model.safetensors").is_file()
    assert resolve_model_path(settings(model=str(bundled_path))) == ("model", bundled_path)


def test_resolves_hub_ids_offline_from_a_filled_cache(
    bundled_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--mini"
    model_copy(bundled_path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = settings(model="acme/mini", model_cache_dir=str(tmp_path))
    assert resolve_model_path(hub) == ("acme/mini", repo / "snapshots" / commit)
    with pytest.raises(ModelLoadError, match="KEMBED_MODEL='acme/other' is not a folder"):
        resolve_model_path(settings(model="acme/other", model_cache_dir=str(tmp_path)))


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_cuda_close_to_fp32_cpu(stock_model: EmbeddingModel) -> None:
    cuda = EmbeddingModel.load(settings(device="cuda"))
    assert cuda.info.dtype == torch.bfloat16
    reference = embed(stock_model, TEXTS)
    assert worst_cosine(embed(cuda, TEXTS), reference) >= 0.999
    cuda.compile(Graphs.CAPTURE, planned_shapes=1)  # one batch of every text
    for _ in range(3):  # warm-up, capture, replay
        compiled = embed(cuda, TEXTS)
    assert worst_cosine(compiled, reference) >= 0.999
