#!/usr/bin/env bash
# kembed's GPU measurements on a lent GPU machine, in one device call of at most 600 s.
# Run THERE, from the repo root, with .gpu-carry carried (bash bench/gpu_carry.sh builds it here):
#
#   bash bench/gpu_session.sh [PHASE ...]        default: env ceiling serve
#
# Phases, in the order given (each in its own process group, with its own time limit, under one
# budget; a phase that fails or times out is reported and the next one runs):
#   env      nvidia-smi, cores, memory; python, torch, CUDA, grpc, protobuf, pydantic versions; every
#            import the benchmarks need; the model kembed will load. No GPU needed.
#   test     pytest -q tests/server/test_gpu.py (every planned shape replays a CUDA graph, no
#            recompiles, bf16 vs fp32 cosine)
#   ceiling  python -m bench.compute.ceiling --device cuda --compile on --name ceiling_gpu: the in-process
#            compiled ceiling the serve loads are judged against (run it in the same call as serve)
#   serve    python -m bench.serving.hostpath --parts serve: python -m kembed with KEMBED_FRONTENDS=auto,
#            closed-loop load from several client processes at 1 and 16 texts a call, GPU busy from
#            nvidia-smi during each load, then one 1-text load under py-spy
#   gpu      python -m bench.compute.gpu --parts models: compiled vs eager vs bare compiled, MiniLM and BERT-base
#   startup  python -m bench.compute.gpu --parts startup: cold and warm start-ups per KEMBED_GRAPHS mode
#
# Environment (all optional): PYTHON (python3), OUT (./gpu-out), GPU_SESSION_BUDGET_S (570: the whole
# script, under the device tool's 600 s), GPU_SESSION_LIMIT_<PHASE> (seconds, e.g. GPU_SESSION_LIMIT_SERVE=400),
# CEILING_ARGS, HOSTPATH_ARGS, GPU_ARGS, PYTEST_ARGS (appended to that phase's command; later flags win).
#
# $OUT gets at most 8 files (the device tool's limit): summary.txt, session.log, results.tgz (every
# result, server log and py-spy profile this run wrote), and the JSONs of ceiling, serve and gpu.
# The GPU host runs its own torch (2.11 there), not the pinned 2.13.0: every JSON records the version.
set -uo pipefail
set +m  # no job control: a background `setsid` then leads its own process group, pid = pgid

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-out}
BUDGET=${GPU_SESSION_BUDGET_S:-570}
STARTED=$(date +%s)
DEADLINE=$((STARTED + BUDGET))
STOP_GRACE=30      # SIGTERM to a phase's group, then SIGKILL this much later (kembed drains up to 25 s)
KNOWN_PHASES="env test ceiling serve gpu startup"
declare -A LIMIT=([env]=120 [test]=300 [ceiling]=240 [serve]=420 [gpu]=560 [startup]=560)

PHASES=("$@")
(( ${#PHASES[@]} )) || PHASES=(env ceiling serve)
for phase in "${PHASES[@]}"; do
    [[ " $KNOWN_PHASES " == *" $phase "* ]] || { echo "usage: $0 [$KNOWN_PHASES]: unknown phase '$phase'" >&2; exit 2; }
done

mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu-session.XXXXXX)
mkdir -p "$WORK/results"
SESSION_LOG=$WORK/session.log
say() { echo "$*" | tee -a "$SESSION_LOG"; }
STATUS=()      # "phase status seconds" per phase, for the summary
CURRENT_PGID=""

stop_group() {  # SIGTERM the phase's process group, SIGKILL what is left after STOP_GRACE s
    local pgid=$1 waited=0
    kill -TERM -- "-$pgid" 2>/dev/null || return 0
    while kill -0 -- "-$pgid" 2>/dev/null && (( waited < STOP_GRACE )); do sleep 1; waited=$((waited + 1)); done
    kill -KILL -- "-$pgid" 2>/dev/null || true
}
on_exit() { [[ -n $CURRENT_PGID ]] && stop_group "$CURRENT_PGID"; }
trap on_exit EXIT
trap 'exit 130' INT TERM

# --- the environment: carried wheels, stubs and model --------------------------------------------
CARRY=$ROOT/.gpu-carry
SITE=$CARRY/site
EXTRA=$CARRY/site-extra  # typing-extensions, only where the host's is older than the carried one
PATHS=()
say "== gpu_session $(date -u +%Y-%m-%dT%H:%M:%SZ): phases ${PHASES[*]}, budget ${BUDGET}s, git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), OUT=$OUT"
PYVER=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])' 2>/dev/null) || { say "no python at '$PY'"; exit 2; }
if [[ -d $CARRY/wheels ]]; then
    if [[ $PYVER == 312 ]]; then
        stamp=$(ls "$CARRY/wheels" | sha256sum | cut -c1-16)
        if [[ -f $SITE/.installed && $(cat "$SITE/.installed") == "$stamp" ]]; then
            say "carried wheels: already installed in $SITE"
        else
            rm -rf "$SITE" "$EXTRA"
            wheels=()
            for w in "$CARRY"/wheels/*.whl; do [[ $w == */typing_extensions-* ]] || wheels+=("$w"); done
            if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
                    --target "$SITE" "${wheels[@]}" >"$WORK/pip.log" 2>&1; then
                echo "$stamp" >"$SITE/.installed"
                say "carried wheels: ${#wheels[@]} installed in $SITE"
            else
                say "carried wheels: pip install FAILED (last lines below; the host's own packages are used)"
                tail -5 "$WORK/pip.log" | tee -a "$SESSION_LOG"
            fi
            te=$(compgen -G "$CARRY/wheels/typing_extensions-*.whl" | head -1)
            if [[ -n $te ]] && "$PY" - "$te" <<'PYEOF'; then
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

def parse(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text)[:3])

carried = parse(Path(sys.argv[1]).name.split("-")[1])
try:
    there = parse(version("typing_extensions"))
except PackageNotFoundError:
    there = ()
sys.exit(0 if there < carried else 1)  # 0: the host's is older (or absent), install the carried one
PYEOF
                "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$EXTRA" "$te" >>"$WORK/pip.log" 2>&1 \
                    && say "carried typing-extensions installed (the host's is older)"
            fi
        fi
        [[ -f $SITE/.installed ]] && PATHS+=("$SITE")
        [[ -d $EXTRA ]] && PATHS+=("$EXTRA")
    else
        say "python is ${PYVER:0:1}.${PYVER:1}, the carry is cp312: wheels NOT installed, this interpreter's own packages are used"
    fi
    # The stubs are generated (make proto), not committed: take the carried ones where there are none.
    if [[ ! -f server/kembed/v1/embedder_pb2.py && -d $CARRY/stubs/kembed/v1 ]]; then
        cp "$CARRY"/stubs/kembed/v1/*_pb2* server/kembed/v1/ && say "gRPC stubs: copied from the carry"
    fi
    if [[ -f $CARRY/stubs/PROTO_SHA256 ]] && \
       [[ $(sha256sum protos/kembed/v1/embedder.proto | cut -d' ' -f1) != $(cat "$CARRY/stubs/PROTO_SHA256") ]]; then
        say "WARNING: protos/kembed/v1/embedder.proto changed since the carry was built: rebuild it (bash bench/gpu_carry.sh)"
    fi
    # The bundled model package, fp16, ahead of any installed one: the default (empty) KEMBED_MODEL
    # then loads it everywhere. KEMBED_MODEL=<folder> would not do: the tests pass their own settings,
    # bench.tools.server drops KEMBED_* from a server's environment, and a folder changes the model id.
    [[ -d $CARRY/model ]] && PATHS+=("$CARRY/model")
else
    say "no .gpu-carry here: this interpreter's packages are used as they are (bash bench/gpu_carry.sh builds it)"
fi
PATHS+=("$ROOT/server" "$ROOT")
PYTHONPATH=$(IFS=:; echo "${PATHS[*]}")${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[[ -d $SITE/bin ]] && export PATH=$SITE/bin:$PATH  # py-spy
say "PYTHONPATH=$PYTHONPATH"
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>>"$WORK/cuda.log"; then
    CUDA=1
else
    CUDA=0
    say "no CUDA device here: the GPU phases (test ceiling serve gpu startup) are skipped"
fi

# --- phases ----------------------------------------------------------------------------------------
env_report() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    echo "cores: $(nproc); $(grep MemTotal /proc/meminfo); load: $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PY" - <<'PYEOF'
import importlib
import platform
from importlib.metadata import PackageNotFoundError, version

def v(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"

problems = []
try:
    import torch
except Exception as err:  # report the rest all the same
    torch = None
    problems.append(f"torch: {type(err).__name__}: {err}")
print(f"python {platform.python_version()} ({platform.machine()}), torch {v('torch')} (kembed pins 2.13.0), "
      f"CUDA runtime {torch.version.cuda if torch else '?'}")
for name in ("grpcio", "protobuf", "pydantic", "pydantic-core", "typing-extensions", "transformers", "tokenizers",
             "safetensors", "sentence-transformers", "numpy", "prometheus-client", "pytest", "pytest-asyncio",
             "pytest-timeout", "triton", "py-spy"):
    print(f"  {name} {v(name)}")
for module in ("grpc", "google.protobuf", "pydantic", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection",
               "prometheus_client", "kembed.v1.embedder_pb2", "kembed.v1.embedder_pb2_grpc", "kembed.config",
               "kembed.supervisor.process", "kembed.engine.worker", "bench.serving.hostpath.run", "bench.compute.ceiling",
               "bench.compute.gpu", "pytest_asyncio", "pytest_timeout", "sentence_transformers"):
    try:
        importlib.import_module(module)
    except Exception as err:  # report every missing piece, not just the first
        problems.append(f"{module}: {type(err).__name__}: {err}")
try:
    import grpc
    from safetensors import safe_open

    from kembed.config import Settings
    from kembed.engine.model import resolve_model_path

    settings = Settings.from_env({})
    model_id, path = resolve_model_path(settings)
    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        dtype = f.get_slice(next(iter(f.keys()))).get_dtype()
    print(f"grpc {grpc.__version__}; model {model_id} at {path} (weights stored as {dtype}); "
          f"KEMBED_FRONTENDS=auto -> {settings.frontend_count()} front ends")
except Exception as err:
    problems.append(f"model: {type(err).__name__}: {err}")
print("imports: " + ("all ok" if not problems else "PROBLEMS\n  " + "\n  ".join(problems)))
if torch is not None and torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"CUDA: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
else:
    print("CUDA: not available on this machine (the GPU phases skip)")
raise SystemExit(1 if problems else 0)
PYEOF
}

phase_command() {  # the command of a phase, with its extra arguments
    local limit=$1
    case $2 in
        env) echo env_report ;;
        test) echo "$PY -m pytest -q -p no:cacheprovider tests/server/test_gpu.py ${PYTEST_ARGS:-}" ;;
        ceiling) echo "$PY -m bench.compute.ceiling --device cuda --compile on --name ceiling_gpu --max-seconds 120 ${CEILING_ARGS:-}" ;;
        serve) echo "$PY -m bench.serving.hostpath --parts serve --serve-ceiling ceiling_gpu --client-processes 6 --concurrency 64" \
                    "--channels 4 --duration 12 --warmup 3 --windows 3 --py-spy-seconds 10" \
                    "--serve-start-timeout $((limit > 180 ? limit - 90 : 90)) ${HOSTPATH_ARGS:-}" ;;
        gpu) echo "$PY -m bench.compute.gpu --parts models ${GPU_ARGS:-}" ;;
        startup) echo "$PY -m bench.compute.gpu --parts startup ${GPU_ARGS:-}" ;;
    esac
}

run_phase() {
    local name=$1 limit var now left started log marker pgid rc status
    var=GPU_SESSION_LIMIT_${name^^}
    limit=${!var:-${LIMIT[$name]}}
    now=$(date +%s)
    left=$((DEADLINE - now - STOP_GRACE - 5))  # room to stop the phase's processes within the budget
    if [[ $name != env && $CUDA == 0 ]]; then
        STATUS+=("$name skipped(no-CUDA) 0"); say "== $name: skipped, no CUDA device"; return
    fi
    if (( left < 30 )); then
        STATUS+=("$name skipped(no-time) 0"); say "== $name: skipped, ${left}s left of the budget"; return
    fi
    (( limit > left )) && limit=$left
    log=$WORK/$name.log
    marker=$WORK/.start-$name
    touch "$marker"
    local cmd
    cmd=$(phase_command "$limit" "$name")
    say "== $name (limit ${limit}s): $cmd"
    started=$(date +%s)
    if [[ $name == env ]]; then
        export -f env_report
        export PY
    fi
    # A new session, so the phase and every process it starts (servers, client processes, py-spy)
    # share one process group, stopped as one.
    setsid bash -c "$cmd" >"$log" 2>&1 </dev/null &
    pgid=$!
    CURRENT_PGID=$pgid
    sleep 1  # setsid has run by now: the phase leads its own group (field 5 of /proc/PID/stat)
    [[ ! -e /proc/$pgid/stat || $(awk '{print $5}' "/proc/$pgid/stat" 2>/dev/null) == "$pgid" ]] \
        || say "WARNING: $name does not lead its own process group; stopping it may leave processes behind"
    status=""
    while kill -0 "$pgid" 2>/dev/null; do
        if (( $(date +%s) - started >= limit )); then
            status="TIMEOUT"
            say "== $name: over its ${limit}s limit: stopping its process group"
            stop_group "$pgid"
            break
        fi
        sleep 1
    done
    wait "$pgid"
    rc=$?
    kill -0 -- "-$pgid" 2>/dev/null && { say "   ($name left processes behind: stopped)"; stop_group "$pgid"; }
    CURRENT_PGID=""
    [[ -n $status ]] || { (( rc == 0 )) && status=ok || status="FAILED(rc=$rc)"; }
    STATUS+=("$name $status $(( $(date +%s) - started ))")
    # What the phase wrote under bench/results (JSON, server logs, py-spy profiles), kept per phase.
    mkdir -p "$WORK/results/$name"
    find bench/results -maxdepth 1 -type f -newer "$marker" -exec cp {} "$WORK/results/$name/" \; 2>/dev/null
    say "-- $name: $status in $(( $(date +%s) - started ))s; last lines of its log:"
    tail -n 25 "$log" | tee -a "$SESSION_LOG"
}

for phase in "${PHASES[@]}"; do
    run_phase "$phase"
done

# --- summary and $OUT ------------------------------------------------------------------------------
summarize() {
    local gpu left
    gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
    echo "== summary: ${gpu:-no GPU}; $(( $(date +%s) - STARTED ))s of the ${BUDGET}s budget"
    if [[ -n $gpu ]]; then
        left=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null)
        echo "processes left on the GPU: ${left:-none}"
    fi
    printf '%-8s %-20s %s\n' phase status seconds
    # shellcheck disable=SC2086  # each row is three words
    for row in "${STATUS[@]}"; do printf '%-8s %-20s %s\n' $row; done
    [[ -f $WORK/test.log ]] && echo "test: $(grep -E '[0-9]+ (passed|failed|error|skipped)' "$WORK/test.log" | tail -1)"
    "$PY" - "$WORK/results" <<'PYEOF' 2>&1
import json
import sys
from pathlib import Path

results = Path(sys.argv[1])

def read(phase: str, name: str) -> dict | None:
    path = results / phase / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None

try:
    from bench import headline
    from bench.tools.report import ratio_table
except Exception as err:  # the summary must not die with the environment
    print(f"(no tables: bench.headline does not import: {err})")
    raise SystemExit(0)
torch_seen = set()
if ceiling := read("ceiling", "ceiling_gpu"):
    torch_seen.add(ceiling["machine"]["torch"])
    print(f"ceiling ({ceiling['device']}, {ceiling['dtype']}, compiled={ceiling['compiled']}):")
    print(headline.ceiling_table(ceiling))
if hostpath := read("serve", "hostpath"):
    torch_seen.add(hostpath["machine"]["torch"])
    serve = hostpath.get("serve", {})
    print(f"serve: {serve.get('info', {}).get('device')} {serve.get('info', {}).get('dtype')}, {serve.get('settings')}")
    print(ratio_table(headline.serve_ratios(serve)))
    for load in serve.get("loads", []):
        w = load.get("worker", {})
        print(f"  {load['texts_per_call']} text(s): codes {load['codes']}, server CPU cores "
              f"{load['cpu_cores']['server']:.1f}, client {load['cpu_cores']['client']:.1f}; worker busy "
              f"{w.get('busy_share', float('nan')):.0%}, rows/batch {w.get('rows_per_batch', float('nan')):.1f}, "
              f"padding {load.get('padding_ratio', float('nan')):.0%}")
    if spy := serve.get("py_spy"):
        print(f"  py-spy: {[p.get('file') for p in spy.get('processes', [])]} {spy.get('error', '')}")
for phase in ("gpu", "startup"):
    if gpu := read(phase, "gpu"):
        torch_seen.add(gpu["machine"]["torch"])
        if gpu.get("startup"):
            for mode, run in gpu["startup"].items():
                print(f"start-up {mode}: {run}")
        if gpu.get("runs"):
            print(headline.gpu_table(gpu))
if torch_seen and not all(t.startswith("2.13.0") for t in torch_seen):
    print(f"torch here: {', '.join(sorted(torch_seen))}, not kembed's pin 2.13.0: say so beside these figures")
PYEOF
}
summarize >"$WORK/summary.txt" 2>&1
cat "$WORK/summary.txt" >>"$SESSION_LOG"
for phase in "${PHASES[@]}"; do
    [[ -f $WORK/$phase.log ]] && { echo "=== $phase.log"; cat "$WORK/$phase.log"; } >>"$SESSION_LOG"
done
cp "$WORK/summary.txt" "$SESSION_LOG" "$OUT/"
declare -A KEY_JSON=([ceiling/ceiling_gpu]=ceiling_gpu [serve/hostpath]=hostpath_serve [gpu/gpu]=gpu_models
                     [startup/gpu]=gpu_startup)
for src in "${!KEY_JSON[@]}"; do
    [[ -f $WORK/results/$src.json ]] && cp "$WORK/results/$src.json" "$OUT/${KEY_JSON[$src]}.json"
done
tar -C "$WORK" -czf "$OUT/results.tgz" --exclude=session.log --exclude='.start-*' . 2>/dev/null
echo
cat "$WORK/summary.txt"
echo "(in $OUT: $(cd "$OUT" && ls | tr '\n' ' '))"
rm -rf "$WORK"
