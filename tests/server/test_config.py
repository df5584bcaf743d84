"""Settings from KEMBED_* variables: errors name the variable."""

import re
from pathlib import Path

import pytest

from kembed.__main__ import main
from kembed.config.settings import Settings
from kembed.config.table import env_table, env_tables, group_of
from kembed.config.values import Admission, ConfigError, Group
from kembed.contract import env_name

ROOT = Path(__file__).parents[2]


def test_defaults_need_no_environment():
    settings = Settings.from_env({})
    assert settings.buckets == [16, 32, 64, 128, 256, 512]
    assert settings.admission == [Admission.THROUGHPUT, Admission.LATENCY]
    assert settings.grpc_host == "127.0.0.1" and settings.grpc_port == 50051


def test_lists_and_numbers_parse_from_strings():
    settings = Settings.from_env(
        {"KEMBED_BUCKETS": "8, 64", "KEMBED_CONTROL_TOKENS": "[query],[title]", "KEMBED_MAX_DRAIN_MS": "250"}
    )
    assert settings.buckets == [8, 64]
    assert settings.control_tokens == ["[query]", "[title]"]
    assert settings.max_drain_ms == 250.0
    assert Settings.from_env({"KEMBED_ADMISSION": ""}).admission == []


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        ('["[query]", ","]', ["[query]", ","]),
        ('["a,b", " c "]', ["a,b", " c "]),
        ("[]", []),
        ("[query]", ["[query]"]),  # no JSON (unquoted): comma-separated, as before
        ("[query], [title] ,", ["[query]", "[title]"]),
    ],
)
def test_a_list_setting_is_a_json_list_or_comma_separated(value: str, tokens: list[str]):
    assert Settings.from_env({"KEMBED_CONTROL_TOKENS": value}).control_tokens == tokens


def test_list_settings_of_other_types_read_json_too():
    settings = Settings.from_env({"KEMBED_BUCKETS": "[8, 64]", "KEMBED_ADMISSION": '["latency"]'})
    assert (settings.buckets, settings.admission) == ([8, 64], [Admission.LATENCY])


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KEMBED_MAX_BATCH_SIZE": "lots"}, "KEMBED_MAX_BATCH_SIZE"),
        ({"KEMBED_BUCKETS": "64,32"}, "KEMBED_BUCKETS"),
        ({"KEMBED_POOLING": "max"}, "KEMBED_POOLING"),
        ({"KEMBED_ADMISSION": "throughput,vibes"}, "KEMBED_ADMISSION"),
        ({"KEMBED_P95_SOFT_MS": "900", "KEMBED_P95_HARD_MS": "800"}, "KEMBED_P95_SOFT_MS"),
        ({"KEMBED_MAX_BATCH_SZE": "8"}, "KEMBED_MAX_BATCH_SZE"),
        ({"KEMBED_GRPC_PORT": "70000"}, "KEMBED_GRPC_PORT"),
        ({"KEMBED_GRPC_PORT": "-1"}, "KEMBED_GRPC_PORT"),  # REST's any free port; gRPC's is 0
        ({"KEMBED_REST_PORT": "-2"}, "KEMBED_REST_PORT"),
        ({"KEMBED_PROMPTS": "{not json"}, "KEMBED_PROMPTS"),
        ({"KEMBED_PROMPTS": '{"a b": "query: "}'}, "KEMBED_PROMPTS"),  # a name a request could not give
        ({"KEMBED_PROMPTS": '{"q": 5}'}, "KEMBED_PROMPTS"),
        ({"KEMBED_DEFAULT_PROMPT_NAME": "-x"}, "KEMBED_DEFAULT_PROMPT_NAME"),
        ({"KEMBED_LOG_LEVEL": "loud"}, "KEMBED_LOG_LEVEL"),
        ({"KEMBED_CONTROL_TOKENS": '["[q]", 1]'}, "KEMBED_CONTROL_TOKENS"),
        ({"KEMBED_CONTROL_TOKENS": '["[q]", ""]'}, "KEMBED_CONTROL_TOKENS"),
    ],
)
def test_bad_values_name_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        Settings.from_env(env)


def test_every_setting_is_in_one_groups_table():
    tables = {group: env_table(group) for group in Group}
    for name in Settings.model_fields:
        holding = [group for group, table in tables.items() if f"`{env_name(name)}`" in table]
        assert holding == [group_of(name)], name
    assert all(table.count("\n") >= 3 for table in tables.values())  # no group is empty


def test_the_docs_tables_are_current():
    """The tables in docs/configuration.md are exactly what ``--env-table`` prints."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = "<!-- env-table:start -->\n", "\n<!-- env-table:end -->"
    assert page.count(begin) == 1 and page.count(end) == 1, "docs/configuration.md lacks the env-table markers"
    assert page[page.index(begin) + len(begin) : page.index(end)] == env_tables(), (
        "docs/configuration.md's settings tables are stale: paste `make env-table` there"
    )


def test_help_lists_the_main_settings_and_points_to_the_rest(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    said = capsys.readouterr().out
    for name in ("model", "served_model_name", "dtype", "grpc_port", "rest_port", "http_port"):
        assert f"{env_name(name)}=" in said
    assert "--env-table" in said and "docs/configuration.md" in said


def test_the_operators_variables_are_not_the_servers_to_refuse():
    """The server and the operator can share a shell's environment: every KEMBED_* variable the
    operator's chart sets is accepted (KEMBED_OPERATOR_* ignored, anything else a server setting)."""
    chart = (ROOT / "charts" / "kembed-operator" / "templates" / "deployment.yaml").read_text()
    names = set(re.findall(r"name: (KEMBED_\w+)", chart))
    assert "KEMBED_OPERATOR_DEFAULT_IMAGE" in names
    settings = Settings.from_env({name: "x" for name in names} | {"KEMBED_GRPC_PORT": "6000"})
    assert settings.grpc_port == 6000
    assert not any(name.startswith("operator_") for name in Settings.model_fields)  # none would be read


@pytest.mark.parametrize("typo", ["KEMBED_OPERATR_DEFAULT_IMAGE", "KEMBED_OPERATOR", "KEMBED_MODLE"])
def test_other_unknown_variables_are_still_refused(typo: str):
    with pytest.raises(ConfigError, match=f"{typo}: unknown setting"):
        Settings.from_env({typo: "x"})


def test_frontends_auto_follows_the_cpus(monkeypatch: pytest.MonkeyPatch):
    import kembed.config.settings

    for cpus, expected in ((1, 1), (2, 1), (4, 1), (6, 2), (16, 7), (64, 8)):
        monkeypatch.setattr(kembed.config.settings, "available_cpus", lambda _request=0, cpus=cpus: float(cpus))
        assert Settings(frontends="auto").frontend_count() == expected
    assert Settings(frontends="3").frontend_count() == 3
    with pytest.raises(ConfigError, match="KEMBED_FRONTENDS"):
        Settings.from_env({"KEMBED_FRONTENDS": "0"})


CPU_CASES = {
    # (affinity, cgroup cpu.max or None for no file, request in millicores): CPUs
    "affinity only": (64, None, 0, 64.0),
    "no quota": (64, "max 100000", 0, 64.0),
    "quota below affinity": (64, "250000 100000", 0, 2.5),
    "request below affinity, no limit": (64, "max 100000", 4000, 4.0),
    "request with a fraction": (64, None, 2500, 2.5),
    "the least of the three": (64, "300000 100000", 6000, 3.0),
    "affinity below the request": (2, "max 100000", 4000, 2.0),
    "unreadable cpu.max": (8, "garbage", 0, 8.0),
}


@pytest.mark.parametrize(("affinity", "cpu_max", "millicores", "expected"), CPU_CASES.values(), ids=CPU_CASES.keys())
def test_available_cpus_is_the_least_of_affinity_quota_and_request(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    affinity: int,
    cpu_max: str | None,
    millicores: int,
    expected: float,
):
    import kembed.config.values

    monkeypatch.setattr(kembed.config.values.os, "sched_getaffinity", lambda _pid: set(range(affinity)))
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    assert kembed.config.values.available_cpus(millicores, path) == expected


def test_frontends_auto_sizes_from_the_pods_cpu_request(monkeypatch: pytest.MonkeyPatch):
    """A pod that requested 4 CPUs on a 64-core node without a CPU limit: 1 front end, not 8."""
    import kembed.config.values

    monkeypatch.setattr(kembed.config.values.os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr(kembed.config.values, "CGROUP_CPU_MAX", Path("/nonexistent/cpu.max"))
    assert Settings.from_env({}).frontend_count() == 8
    assert Settings.from_env({"KEMBED_CPU_REQUEST_MILLICORES": "4000"}).frontend_count() == 1
    assert Settings.from_env({"KEMBED_CPU_REQUEST_MILLICORES": "12000"}).frontend_count() == 5
    with pytest.raises(ConfigError, match="KEMBED_CPU_REQUEST_MILLICORES"):
        Settings.from_env({"KEMBED_CPU_REQUEST_MILLICORES": "-1"})
