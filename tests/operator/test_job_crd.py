"""The EmbeddingJob CRD: structural, defaults equal to the operator's, the example valid, bad specs rejected."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import yaml

from kembed_operator import identity, kinds, status
from kembed_operator.job_spec import parse_job_spec
from kembed_operator.spec import InvalidSpec
from tests.operator.conftest import CHART
from tests.operator.test_crd import (
    apply_defaults,
    as_json_schema,
    assert_same_defaults,
    cel_rules,
    structural_problems,
)
from tests.operator.test_job_render import BASE, JOB_FEATURES

Schema = dict[str, Any]


@pytest.fixture(scope="module")
def validator(job_crd_schema: Schema) -> jsonschema.Draft4Validator:
    schema = as_json_schema(job_crd_schema)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def resource(spec: dict[str, Any]) -> dict[str, Any]:
    ej = kinds.EMBEDDING_JOB
    return {"apiVersion": ej.api_version, "kind": ej.kind, "metadata": {"name": "x"}, "spec": spec}


def test_names_and_columns(job_crd: Schema, job_crd_schema: Schema) -> None:
    spec = job_crd["spec"]
    names = spec["names"]
    assert (spec["group"], names["kind"], names["plural"], names["shortNames"]) == (
        identity.GROUP,
        identity.JOB_KIND,
        identity.JOB_PLURAL,
        ["ej"],
    )
    (version,) = spec["versions"]
    assert version["name"] == identity.VERSION and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Service", "Status", "Done", "Running", "Failed", "Rows", "Age"]
    for path in (p for p in columns.values() if not p.startswith(".metadata.")):  # metadata: the API's own
        node = job_crd_schema
        for part in path.split("[")[0].strip(".").split("."):
            node = node["properties"][part]


def test_schema_is_structural(job_crd_schema: Schema) -> None:
    assert structural_problems(job_crd_schema) == []
    assert cel_rules(job_crd_schema) == []  # no CEL: every rule lives in job_spec, tested there


def test_defaults_equal_the_operators(job_crd_schema: Schema, validator: jsonschema.Draft4Validator) -> None:
    defaulted = apply_defaults(job_crd_schema["properties"]["spec"], BASE)
    validator.validate(resource(defaulted))
    assert parse_job_spec(defaulted) == parse_job_spec(BASE)
    assert_same_defaults(defaulted, parse_job_spec(BASE).model_dump(by_alias=True, exclude_none=True, mode="json"))


def test_the_example_is_valid(job_crd_schema: Schema, validator: jsonschema.Draft4Validator) -> None:
    example = yaml.safe_load((CHART / "examples" / "embeddingjob.yaml").read_text())
    validator.validate(example)
    spec = parse_job_spec(apply_defaults(job_crd_schema["properties"]["spec"], example["spec"]))
    assert (spec.shards, spec.pods_at_once, spec.manifest_path) == (16, 4, "wiki/emb.manifest.json")


@pytest.mark.parametrize("spec", JOB_FEATURES.values(), ids=JOB_FEATURES.keys())
def test_every_rendered_feature_is_valid(spec: dict[str, Any], validator: jsonschema.Draft4Validator) -> None:
    validator.validate(resource(spec))


BAD: dict[str, dict[str, Any]] = {
    "no service": {k: v for k, v in BASE.items() if k != "service"},
    "no output": {k: v for k, v in BASE.items() if k != "output"},
    "zero shards": {**BASE, "shards": 0},
    "too many shards": {**BASE, "shards": 10_001},
    "zero parallelism": {**BASE, "parallelism": 0},
    "unknown input format": {**BASE, "input": {**BASE["input"], "format": "csv"}},
    "unknown output format": {**BASE, "output": {**BASE["output"], "format": "csv"}},
    "unknown priority": {**BASE, "priority": "urgent"},
    "unknown truncation direction": {**BASE, "truncationDirection": "up"},
    "negative retries": {**BASE, "retry": {"perShard": -1}},
    "more dimensions than any model has": {**BASE, "dimensions": 100_000},
    "input without a claim": {**BASE, "input": {"path": "x.txt"}},
    "env without a name": {**BASE, "env": [{"value": "1"}]},
    "a prompt name with a space": {**BASE, "promptName": "a query"},
    "an empty prompt name": {**BASE, "promptName": ""},
}


@pytest.mark.parametrize("spec", BAD.values(), ids=BAD.keys())
def test_bad_specs_are_rejected_by_the_schema_and_the_operator(
    spec: dict[str, Any], validator: jsonschema.Draft4Validator
) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(resource(spec))
    with pytest.raises(InvalidSpec):
        parse_job_spec(spec)


def test_the_service_status_fits_its_schema(crd_schema: Schema) -> None:
    """The EmbeddingService's status, as status.compute writes it, fits the generated status schema."""
    observed = status.Observed(
        generation=3,
        deployment=None,
        problem=status.Problem("InvalidSpec", "x"),
        selector="a=b",
        endpoint="dns:///x:1",
        rest_endpoint="http://x/v1",
        model="m",
        metrics=status.NOT_APPLIED,
        transport="tls",
    )
    computed = status.compute(observed, {}, "2026-01-01T00:00:00Z")
    jsonschema.Draft4Validator(as_json_schema(crd_schema["properties"]["status"])).validate(computed)
    assert set(computed) == set(crd_schema["properties"]["status"]["properties"])
