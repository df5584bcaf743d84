"""The CRD: structural, defaults equal to the operator's, examples valid, bad specs rejected."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kembed_operator import crd, identity, kinds
from kembed_operator.spec import EmbeddingServiceSpec, SloSpec, parse_spec
from tests.operator.conftest import CHART, CRD_PATH, JOB_CRD_PATH, ROOT
from tests.operator.test_render import FEATURES, INVALID, bounded

Schema = dict[str, Any]


def structural_problems(node: Schema, path: str = "") -> list[str]:
    """The rules of a structural schema that matter here (see the Kubernetes CRD docs)."""
    problems = []
    free = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in node and not free:
        problems.append(f"{path or '<root>'}: no type")
    for banned in ("$ref", "definitions", "dependencies", "patternProperties"):
        if banned in node:
            problems.append(f"{path}: {banned} is not allowed")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: both properties and additionalProperties")
    for name, child in node.get("properties", {}).items():
        problems += structural_problems(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += structural_problems(node[key], f"{path}[]")
    return problems


def apply_defaults(node: Schema, value: Any) -> Any:
    """What the API server's defaulting does to ``value``."""
    if isinstance(value, dict):
        value = dict(value)
        for name, child in node.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [apply_defaults(node["items"], item) for item in value]
    return value


def as_json_schema(node: Any) -> Any:
    """The CRD dialect as JSON Schema draft 4: int-or-string becomes a type union."""
    if isinstance(node, dict):
        out = {k: as_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        if node.get("x-kubernetes-int-or-string"):
            out["type"] = ["integer", "string"]
        return out
    if isinstance(node, list):
        return [as_json_schema(item) for item in node]
    return node


@pytest.fixture(scope="module")
def spec_schema(crd_schema: Schema) -> Schema:
    return dict(crd_schema["properties"]["spec"])


@pytest.fixture(scope="module")
def validator(crd_schema: Schema) -> jsonschema.Draft4Validator:
    schema = as_json_schema(crd_schema)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def resource(spec: dict[str, Any]) -> dict[str, Any]:
    es = kinds.EMBEDDING_SERVICE
    return {"apiVersion": es.api_version, "kind": es.kind, "metadata": {"name": "x"}, "spec": spec}


def test_the_crds_are_generated_from_the_spec_models() -> None:
    """crds/ and the chart's crds/ hold, byte for byte, what `make crds` writes from the spec models."""
    wanted = crd.files()
    assert {path.rsplit("/", 1)[0] for path in wanted} == {"crds", "charts/kembed-operator/crds"}
    for path, text in wanted.items():
        assert (ROOT / path).read_text() == text, f"{path} is stale: run `make crds`"
    assert (CHART / "crds" / CRD_PATH.name).read_text() == CRD_PATH.read_text()
    assert (CHART / "crds" / JOB_CRD_PATH.name).read_text() == JOB_CRD_PATH.read_text()


def test_the_generator_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crd.main(["--root", str(tmp_path), "--check"]) == 1  # nothing there yet
    assert crd.main(["--root", str(tmp_path)]) == 0
    assert crd.main(["--root", str(tmp_path), "--check"]) == 0
    edited = tmp_path / "charts/kembed-operator/crds" / JOB_CRD_PATH.name
    edited.write_text(edited.read_text().replace("default: 3", "default: 4"))
    capsys.readouterr()
    assert crd.main(["--root", str(tmp_path), "--check"]) == 1
    assert f"charts/kembed-operator/crds/{JOB_CRD_PATH.name}: stale" in capsys.readouterr().err


def test_a_spec_model_change_reaches_the_crd() -> None:
    """The schema follows the models: a bound, a default and a description read back from the file."""
    spec = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    batch_size = spec["spec"]["properties"]["batching"]["properties"]["maxBatchSize"]
    field = EmbeddingServiceSpec.model_fields["min_replicas"]
    assert batch_size["maximum"] == 4096
    assert spec["spec"]["properties"]["minReplicas"]["default"] == field.default
    assert spec["spec"]["properties"]["slo"]["properties"]["p95LatencyMs"]["description"] == (
        SloSpec.model_fields["p95_latency_ms"].description
    )


def test_names_and_subresources(crd: dict[str, Any], crd_schema: Schema) -> None:
    spec = crd["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == (
        identity.GROUP,
        identity.KIND,
        identity.PLURAL,
    )
    assert spec["names"]["shortNames"] == ["es"]
    (version,) = spec["versions"]
    assert version["name"] == identity.VERSION
    scale = version["subresources"]["scale"]
    assert version["subresources"]["status"] == {}
    for path in (scale["specReplicasPath"], scale["statusReplicasPath"], scale["labelSelectorPath"]):
        node = crd_schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] in ("integer", "string"), path
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Replicas", "Model", "Endpoint", "REST", "Transport", "Age"]
    conditions = crd_schema["properties"]["status"]["properties"]["conditions"]
    assert set(conditions["items"]["properties"]) == {"type", "status", "reason", "message", "lastTransitionTime"}


def test_schema_is_structural(crd_schema: Schema) -> None:
    assert structural_problems(crd_schema) == []


def test_defaults_equal_the_operators(spec_schema: Schema, validator: jsonschema.Draft4Validator) -> None:
    defaulted = apply_defaults(spec_schema, {})
    validator.validate(resource(defaulted))
    assert parse_spec(defaulted) == parse_spec({})
    assert_same_defaults(defaulted, parse_spec({}).model_dump(by_alias=True, exclude_none=True, mode="json"))


def assert_same_defaults(crd_value: Any, ours: Any, path: str = "spec") -> None:
    """Every value the CRD's defaulting gave equals the operator's own default for that field."""
    if isinstance(crd_value, dict) and crd_value:
        for key, value in crd_value.items():
            assert_same_defaults(value, ours[key], f"{path}.{key}")
    else:
        assert crd_value == ours, path


@pytest.mark.parametrize("name", ["terminationGraceSeconds", "drainSeconds"])
def test_defaulting_keeps_either_grace_field(
    name: str, spec_schema: Schema, validator: jsonschema.Draft4Validator
) -> None:
    """A resource written with v1alpha1's first name for the field keeps its value through defaulting."""
    defaulted = apply_defaults(spec_schema, {name: 40})
    validator.validate(resource(defaulted))
    assert parse_spec(defaulted).grace_seconds == 40


def test_defaults_reach_nested_objects(spec_schema: Schema) -> None:
    defaulted = apply_defaults(spec_schema, {"model": {"hub": {"id": "x"}}, "autoscaling": {"provider": "keda"}})
    assert defaulted["model"]["hub"]["cacheSizeLimit"] == "20Gi"
    assert defaulted["model"]["pooling"] == "auto"
    assert defaulted["autoscaling"]["keda"]["pollingInterval"] == 15
    assert defaulted["slo"]["p95LatencyMs"] == 1000


def test_chart_example_is_valid(spec_schema: Schema, validator: jsonschema.Draft4Validator) -> None:
    example = yaml.safe_load((CHART / "examples" / "embeddingservice.yaml").read_text())
    validator.validate(example)
    parse_spec(apply_defaults(spec_schema, example["spec"]))


@pytest.mark.parametrize("spec", FEATURES.values(), ids=FEATURES.keys())
def test_every_rendered_feature_is_valid(spec: dict[str, Any], validator: jsonschema.Draft4Validator) -> None:
    validator.validate(resource(spec))


BAD: dict[str, dict[str, Any]] = {
    "zero replicas": {"minReplicas": 0},
    "negative gpu": {"resources": {"gpu": -1}},
    "unknown pooling": {"model": {"pooling": "max"}},
    "unknown dtype": {"model": {"dtype": "int4"}},
    "hub without id": {"model": {"hub": {"revision": "main"}}},
    "pvc without claim": {"model": {"pvc": {"path": "x"}}},
    "slo as text": {"slo": {"p95LatencyMs": "fast"}},
    "zero slo": {"slo": {"p95LatencyMs": 0}},
    "zero drain budget": {"admission": {"maxDrainMs": 0}},
    "unknown strategy": {"admission": {"strategies": ["random"]}},
    "unknown provider": {"autoscaling": {"provider": "vpa"}},
    "behavior not an object": {"autoscaling": {"behavior": "fast"}},
    "unknown service type": {"service": {"type": "LoadBalancer"}},
    "too many buckets": {"batching": {"buckets": list(range(1, 18))}},
    "huge batch": {"batching": {"maxBatchSize": 10000}},
    "env without name": {"env": [{"value": "1"}]},
    "short startup": {"startupTimeoutSeconds": 1},
    "negative grace": {"terminationGraceSeconds": -1},
    "negative deprecated grace": {"drainSeconds": -1},
}


@pytest.mark.parametrize("spec", BAD.values(), ids=BAD.keys())
def test_bad_specs_are_rejected(spec: dict[str, Any], validator: jsonschema.Draft4Validator) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(resource(spec))


BOUNDS = {f"{key} refused": (spec, False) for key, (spec, _) in bounded(False).items()} | {
    f"{key} accepted": (spec, True) for key, (spec, _) in bounded(True).items()
}


@pytest.mark.parametrize(("spec", "accepted"), BOUNDS.values(), ids=BOUNDS.keys())
def test_the_schema_bounds_what_the_operator_bounds(
    spec: dict[str, Any], accepted: bool, validator: jsonschema.Draft4Validator
) -> None:
    """The spec models' patterns and bounds are the schema's: the API server refuses what the operator would."""
    assert validator.is_valid(resource(spec)) is accepted


# No CEL evaluator here: each rule has a twin in kembed_operator.spec/render, tested in test_render.
CEL_TWINS = {
    "!has(self.maxReplicas) || self.maxReplicas >= self.minReplicas": "max below min",
    "!(has(self.pvc) && has(self.hub))": "both model sources",
    "!has(self.p95SoftMs) || !has(self.p95HardMs) || self.p95SoftMs <= self.p95HardMs": "explicit soft above hard",
    "self.isSorted()": "unsorted buckets",
}


def cel_rules(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [rule["rule"] for rule in node.get("x-kubernetes-validations", [])]
        return own + [rule for value in node.values() for rule in cel_rules(value)]
    if isinstance(node, list):
        return [rule for item in node for rule in cel_rules(item)]
    return []


def test_every_cel_rule_has_a_tested_python_twin(crd_schema: Schema) -> None:
    assert sorted(cel_rules(crd_schema)) == sorted(CEL_TWINS)
    assert set(CEL_TWINS.values()) <= set(INVALID)
