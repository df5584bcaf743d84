"""Which dtype the model serves in (``KEMBED_DTYPE``), and why.

An explicit dtype wins. ``auto`` serves bf16 on CUDA. On a CPU it serves bf16 only where the CPU
has bf16 units (x86 ``amx_bf16`` or ``avx512_bf16``, Arm ``bf16``, read from ``/proc/cpuinfo``;
without them bf16 runs about 2.5x slower than fp32, so nothing is measured) and only where warmup
finds it both faster and accurate: timed against fp32 on the warmup batches, at least
``MIN_SPEEDUP`` faster, and the cosine between its vectors and fp32's on :data:`PROBE_TEXTS` (real
text of every length, not random ids) at least ``MIN_COSINE`` for every text. Otherwise fp32. The
reason is logged and published with the dtype (Info, ``/health``, ``kembed_serving_dtype``).

The decisions are pure (:func:`measures`, :func:`unmeasured`, :func:`measured`); the worker runs
the measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kembed.config.values import Dtype
from kembed.contract import env_name

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 (AMX, AVX512-BF16), then Arm's feature name
MIN_COSINE = 0.999
# bf16 gives up some accuracy (cosine ~0.9999 to fp32): it must be clearly faster to be worth it,
# not faster within the noise of a warmup on shared cores. With AMX it measured 3.3x; with
# avx512_bf16 alone 0.66x to 0.78x, and once faster on the same machine: the floor lies well clear
# of both, so the same CPU does not choose one dtype on one start and the other on the next.
MIN_SPEEDUP = 1.3

# Varied real text for the accuracy check: questions, titles, prose of every length, numbers,
# code, other languages. Vectors of random ids say nothing of how the model behaves on language.
PROBE_TEXTS = (
    "What is the capital of France?",
    "how do i reset my password",
    "Kubernetes horizontal pod autoscaler custom metrics",
    "The quick brown fox jumps over the lazy dog.",
    "Error: connection refused (port 50051)",
    "Quarterly revenue rose 12.5% to $4.2 billion, beating analysts' estimates.",
    "def embed(texts: list[str]) -> np.ndarray: return model.encode(texts, normalize_embeddings=True)",
    "Le chat dort sur le canapé pendant que la pluie tombe.",
    "Die Bahn fährt heute wegen Bauarbeiten nur bis Hannover.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "A batch that waits for its slowest member wastes the time of every other member.",
    "She opened the letter slowly, afraid of what it might say, and then laughed out loud.",
    "Admission control rejects requests early and cheaply instead of queueing them into timeouts, "
    "so clients back off while the server still answers quickly.",
    "The mitochondrion is the organelle in which cellular respiration takes place; it has its own "
    "DNA, inherited from the mother, and its inner membrane is folded into cristae that enlarge "
    "the surface on which the electron transport chain works.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon. Neil Armstrong stepped onto "
    "the surface first, followed by Buzz Aldrin, while Michael Collins orbited above in the command "
    "module. The landing was watched on television by an estimated 650 million people, and the "
    "samples they brought back are still studied today.",
    "Embedding models map text to vectors so that texts with similar meanings lie close together. "
    "A search system embeds its documents once, stores the vectors in an index, and at query time "
    "embeds the query and looks up its nearest neighbours. The quality of the results depends on "
    "the model, on how documents are split into passages, and on whether queries and passages are "
    "embedded the same way: with the same tokenizer, the same pooling and the same normalisation. "
    "Serving such a model well means computing many short texts together without padding them to "
    "the length of the longest, and answering quickly when the server is busy.",
)


@dataclass(frozen=True)
class Precision:
    """The dtype a model serves in, and why."""

    dtype: str  # a torch dtype's name: "float32", "bfloat16", "float16"
    why: str


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The feature flags this CPU reports (none where the file cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    flags = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return flags


def bf16_units(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The bf16 flags this CPU reports (none where the file cannot be read)."""
    flags = cpu_flags(cpuinfo)
    return tuple(flag for flag in BF16_FLAGS if flag in flags)


def loaded_first(asked: Dtype, device_type: str) -> Dtype:
    """The dtype a model loads in: as asked; auto, bf16 on CUDA and fp32 elsewhere (on a CPU with
    bf16 units, what bf16 is measured against)."""
    if asked is not Dtype.AUTO:
        return asked
    return Dtype.BFLOAT16 if device_type == "cuda" else Dtype.FLOAT32


def measures(asked: Dtype, device_type: str, units: Sequence[str]) -> bool:
    """Whether warmup times bf16 against fp32: auto, on a CPU with bf16 units."""
    return asked is Dtype.AUTO and device_type == "cpu" and bool(units)


def unmeasured(asked: Dtype, device_type: str, units: Sequence[str]) -> Precision:
    """The dtype served without measuring, and why."""
    dtype = loaded_first(asked, device_type).value
    if asked is not Dtype.AUTO:
        return Precision(dtype, f"{env_name('dtype')}={asked.value}")
    if device_type == "cuda":
        return Precision(dtype, "auto: bf16 on CUDA")
    if units:
        return Precision(dtype, f"auto: bf16 units ({', '.join(units)}), not measured when compiled")
    return Precision(dtype, f"auto: no bf16 units (none of {', '.join(BF16_FLAGS)})")


def measured(fp32_seconds: float, bf16_seconds: float, min_cosine: float) -> Precision:
    """Auto on a CPU with bf16 units, once warmup has timed both on the same batches and compared
    bf16's vectors with fp32's: bf16 where it is accurate and at least ``MIN_SPEEDUP`` faster."""
    speedup = fp32_seconds / bf16_seconds if bf16_seconds > 0 else 0.0
    figures = f"bf16 {speedup:.2f}x fp32's speed, min cosine {min_cosine:.5f}"
    if min_cosine < MIN_COSINE:
        return Precision(Dtype.FLOAT32.value, f"auto: {figures}, under {MIN_COSINE}")
    if speedup < MIN_SPEEDUP:
        return Precision(Dtype.FLOAT32.value, f"auto: {figures}, not {MIN_SPEEDUP}x")
    return Precision(Dtype.BFLOAT16.value, f"auto: {figures}")
