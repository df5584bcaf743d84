"""Settings from KEMBED_* variables: errors name the variable."""

from pathlib import Path

import pytest

from kembed.config import Admission, ConfigError, Settings, env_table
from kembed.contract import env_name


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
    ("env", "named"),
    [
        ({"KEMBED_MAX_BATCH_SIZE": "lots"}, "KEMBED_MAX_BATCH_SIZE"),
        ({"KEMBED_BUCKETS": "64,32"}, "KEMBED_BUCKETS"),
        ({"KEMBED_POOLING": "max"}, "KEMBED_POOLING"),
        ({"KEMBED_ADMISSION": "throughput,vibes"}, "KEMBED_ADMISSION"),
        ({"KEMBED_P95_SOFT_MS": "900", "KEMBED_P95_HARD_MS": "800"}, "KEMBED_P95_SOFT_MS"),
        ({"KEMBED_MAX_BATCH_SZE": "8"}, "KEMBED_MAX_BATCH_SZE"),
        ({"KEMBED_GRPC_PORT": "70000"}, "KEMBED_GRPC_PORT"),
        ({"KEMBED_LOG_LEVEL": "loud"}, "KEMBED_LOG_LEVEL"),
    ],
)
def test_bad_values_name_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        Settings.from_env(env)


def test_every_setting_has_a_documented_variable():
    table = env_table()
    for name in Settings.model_fields:
        assert f"`{env_name(name)}`" in table


def test_readme_table_is_current():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert env_table() in readme, "README's configuration table is stale: paste `make env-table` into it"


def test_frontends_auto_follows_the_cpus(monkeypatch: pytest.MonkeyPatch):
    import kembed.config

    for cpus, expected in ((1, 1), (2, 1), (4, 1), (6, 2), (16, 7), (64, 8)):
        monkeypatch.setattr(kembed.config, "available_cpus", lambda cpus=cpus: float(cpus))
        assert Settings(frontends="auto").frontend_count() == expected
    assert Settings(frontends="3").frontend_count() == 3
    with pytest.raises(ConfigError, match="KEMBED_FRONTENDS"):
        Settings.from_env({"KEMBED_FRONTENDS": "0"})
