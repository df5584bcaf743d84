"""The serving-efficiency bench's machinery: the stand-in model, the stage rules and the CPU
accounting's arithmetic (the stages of a process add up to its CPU)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open

from bench.headline import efficiency_ratios, gpu_projection
from bench.serving.efficiency import Load
from bench.serving.efficiency_plot import parts
from bench.tools.cpu_account import CpuSnapshot, Proc, ProcCpu, ThreadSamples, account, stage_of
from bench.tools.standin import model_settings, standin_model

SERVICE = "/x/server/kembed/frontend/service.py"


def test_the_standin_keeps_the_bundled_models_first_layers_and_everything_else(tmp_path: Path) -> None:
    folder = standin_model(2, root=tmp_path)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        layers = {int(k.split(".layer.")[1].split(".")[0]) for k in weights.keys() if ".layer." in k}  # noqa: SIM118
        assert layers == {0, 1}
        assert any(k.startswith("embeddings.") for k in weights.keys())  # noqa: SIM118
    assert (folder / "tokenizer.json").is_file() and (folder / "1_Pooling" / "config.json").is_file()
    assert standin_model(2, root=tmp_path) == folder  # built once
    with pytest.raises(ValueError, match="layers must be"):
        standin_model(7, root=tmp_path)


def test_a_benchs_model_setting_names_the_bundled_model_the_standin_or_a_folder() -> None:
    assert model_settings("bundled") == {}
    assert model_settings("/models/x") == {"model": "/models/x"}


def test_a_sample_is_the_stage_of_its_innermost_kembed_frame() -> None:
    tokenizing = [("asyncio/events.py", "Handle._run"), (SERVICE, "EmbedService._serve"),
                  ("/x/kembed/domain/inputs.py", "Tokenizer.from_texts"), ("tokenizers/x.py", "encode")]  # fmt: skip
    assert stage_of(tokenizing, "runtime") == "tokenize"
    answering = [(SERVICE, "EmbedService._serve"), (SERVICE, "EmbedService._result")]
    assert stage_of(answering, "runtime") == "answer"
    assert stage_of([(SERVICE, "EmbedService._serve")], "runtime") == "service"
    pooled = [("/x/kembed/engine/model.py", "EmbeddingModel._pooled"), ("/x/kembed/engine/pooling.py", "pool")]
    assert stage_of(pooled, "runtime") == "pooling"
    assert stage_of([("asyncio/base_events.py", "_run_once")], "engine: runtime") == "engine: runtime"


def test_a_process_cpu_is_shared_out_over_its_stages_and_adds_up() -> None:
    engine = Proc(10, "engine")
    before = CpuSnapshot({10: ProcCpu(5.0, {10: ("python", 1.0), 11: ("python", 4.0)})})
    after = CpuSnapshot({10: ProcCpu(9.5, {10: ("python", 2.0), 11: ("python", 7.0), 12: ("grpc_poller", 0.5)})})
    samples = {10: {10: ThreadSamples("MainThread", Counter({"engine: loop": 3, "batch formation": 1})),
                    11: ThreadSamples("kembed-worker", Counter({"forward": 9, "pooling": 1}))}}  # fmt: skip
    accounted = account([engine], before, after, samples)["engine"]
    stages = accounted.stages
    assert stages["forward"] == pytest.approx(2.7) and stages["pooling"] == pytest.approx(0.3)
    assert stages["engine: loop"] == pytest.approx(0.75) and stages["batch formation"] == pytest.approx(0.25)
    assert stages["engine: thread grpc_poller"] == pytest.approx(0.5)  # unseen by py-spy: named by its thread
    assert sum(stages.values()) == pytest.approx(4.5)  # the process's own CPU over the window
    assert accounted.threads == pytest.approx({"kembed-worker": 3.0, "MainThread": 1.0, "grpc_poller": 0.5})
    ended = CpuSnapshot({10: ProcCpu(10.5, after.procs[10].threads)})  # a thread that ended used 1 s
    assert account([engine], before, ended, samples)["engine"].stages[
        "engine: ended threads and rounding"
    ] == pytest.approx(1)


def test_loads_are_texts_by_callers() -> None:
    assert Load.parse("16x16") == Load(16, 16) and Load(1, 32).name == "1x32"


def test_the_efficiency_figures_are_judged_at_32_callers_of_one_text() -> None:
    own = {"dtype": "bfloat16", "own": {"name": "eager", "cpu_ms_per_emb": 3.0},
           "st_encode": {"name": "st_encode_bfloat16", "emb_per_s": 400.0}}  # fmt: skip
    load = {"load": "1x32", "server_cpu_ms_per_emb": 4.5, "emb_per_s": {"median": 360.0, "lo": 350.0, "hi": 370.0}}
    result = {"models": [{"model": "standin", "own": own, "loads": [load, {**load, "load": "16x16"}],
                          "refusals": {"frontend_over_served_call": 0.4}}]}  # fmt: skip
    rows = efficiency_ratios(result)
    judged = {row.name: (row.value.median, row.target) for row in rows if row.target}
    assert judged == {
        "standin, 32 callers of 1 text: server CPU per embedding / the model's own (eager, bfloat16)": (1.5, "<= 1.25"),
        "standin, 32 callers of 1 text: emb/s / sentence-transformers encode (bfloat16)": (0.9, ">= 1.10"),
        "standin: a refusal's front-end CPU / a served one-text call's": (0.4, "<= 0.50"),
    }
    assert len(rows) == 5


def test_a_gpu_host_is_projected_from_the_host_costs_per_call() -> None:
    def load(name: str, frontend_ms: float, loop_ms: float) -> dict[str, object]:
        return {"load": name, "cpu_ms_per_call_by_process": {"engine": 5.0, "frontend-0": frontend_ms},
                "cpu_ms_per_call_by_thread": {"engine: MainThread": loop_ms, "engine: kembed-worker": 4.0,
                                              "frontend-0: MainThread": frontend_ms}}  # fmt: skip

    one, many = gpu_projection({"loads": [load("1x32", 1.0, 0.2), load("16x16", 2.0, 0.1)]}, 7, 46_000)
    assert (one["calls_per_s"], one["emb_per_s"], one["bound_by"]) == (5000, 5000, "engine loop")
    assert (many["calls_per_s"], many["emb_per_s"], many["bound_by"]) == (2875, 46_000, "device")
    assert many["limits_calls_per_s"]["front ends"] == 3500


def test_the_plot_splits_a_served_embedding_into_parts_that_add_up() -> None:
    """16-text calls, one refused of two: the parts are per embedding served, and add to its CPU."""
    load = {"load": "16x2", "server_cpu_ms_per_emb": 12.0,
            "cpu_ms_per_call_by_process": {"engine": 90.0, "frontend-0": 5.0, "frontend-1": 1.0},
            "cpu_ms_per_call_by_stage": {"forward": 80.0, "pooling": 2.0, "worker hand-off": 4.0}}  # fmt: skip
    split = parts(load)
    assert sum(split.values()) == pytest.approx(12.0)
    assert split["forward and pooling"] == pytest.approx(82 / 96 * 12)
    assert split["engine loop"] == pytest.approx(4 / 96 * 12)
    assert split["front end"] == pytest.approx(6 / 96 * 12)
