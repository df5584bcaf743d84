"""Render an EmbeddingJob: its Indexed Job, validated strictly against Kubernetes 1.34 (and 1.30, the
oldest version supported), with the corpus command's interface exactly."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kembed.contract import EXIT_EMBED_FINAL, EXIT_EMBED_USAGE, GRPC_PORT
from kembed_operator import identity, job_render, kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import parse_job_spec
from kembed_operator.spec import InvalidSpec, parse_spec

K8S_VERSIONS = ("1.34.0", "1.30.0")
OWNER = render.Owner("wiki", "search", "0000-2222", kinds.EMBEDDING_JOB)
CONFIG = OperatorConfig(default_image="registry.example/kembed-server:9")
SERVICE = job_render.Target("bge", "search", parse_spec({}))
BASE: dict[str, Any] = {
    "service": "bge",
    "input": {"claimName": "corpora", "path": "wiki/texts.txt"},
    "output": {"claimName": "vectors", "path": "wiki/emb.npy"},
    "shards": 16,
}

JOB_FEATURES: dict[str, dict[str, Any]] = {
    "defaults": BASE,
    "jsonl in, parquet out, one claim": {
        **BASE,
        "input": {"claimName": "corpora", "path": "wiki/docs.jsonl", "format": "jsonl", "jsonlField": "body"},
        "output": {"claimName": "corpora", "path": "wiki/emb.parquet"},
    },
    "every option": {
        **BASE,
        "parallelism": 4,
        "dimensions": 256,
        "truncate": False,
        "truncationDirection": "left",
        "priority": "interactive",
        "promptName": "passage",
        "resources": {"cpu": 2, "memory": "4Gi"},
        "image": "registry.example/kembed-server:10",
        "imagePullPolicy": "Always",
        "retry": {"perShard": 5, "maxFailedShards": 2},
        "output": {"claimName": "vectors", "path": "wiki/emb.out", "format": "jsonl"},
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "batch", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "podAnnotations": {"team.example/owner": "search"},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
    },
}


def job(spec: dict[str, Any], target: job_render.Target = SERVICE, generation: int = 1) -> dict[str, Any]:
    return job_render.render_job(OWNER, generation, parse_job_spec(spec), target, CONFIG).manifest


def pod(spec: dict[str, Any], target: job_render.Target = SERVICE) -> dict[str, Any]:
    return dict(job(spec, target)["spec"]["template"]["spec"])


def container(spec: dict[str, Any], target: job_render.Target = SERVICE) -> dict[str, Any]:
    (only,) = pod(spec, target)["containers"]
    return dict(only)


def tls_target(**tls: str) -> job_render.Target:
    return job_render.Target("bge", "search", parse_spec({"tls": tls}))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("spec", JOB_FEATURES.values(), ids=JOB_FEATURES.keys())
def test_the_job_is_valid_kubernetes(spec: dict[str, Any], version: str) -> None:
    for target in (SERVICE, tls_target(secretName="bge-tls", clientCASecretName="clients")):
        manifest = job({**spec, "tls": {"clientSecretName": "wiki-client"}}, target)
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_job_is_owned_by_the_embedding_job_and_carries_its_generation() -> None:
    manifest = job(BASE, generation=7)
    (ref,) = manifest["metadata"]["ownerReferences"]
    assert ref == {
        "apiVersion": kinds.EMBEDDING_JOB.api_version,
        "kind": identity.JOB_KIND,
        "name": "wiki",
        "uid": "0000-2222",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    assert (manifest["metadata"]["name"], manifest["metadata"]["namespace"]) == ("wiki", "search")
    assert manifest["metadata"]["annotations"] == {job_render.GENERATION_ANNOTATION: "7"}


def test_one_indexed_job_with_per_shard_retries() -> None:
    spec = job(BASE)["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 16, 16)
    assert spec["backoffLimitPerIndex"] == 3 and "maxFailedIndexes" not in spec
    assert "backoffLimit" not in spec  # with backoffLimitPerIndex, only the per-index limit counts
    assert spec["podReplacementPolicy"] == "Failed"  # never two pods writing one part
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    fail_index, ignore = spec["podFailurePolicy"]["rules"]
    assert fail_index == {
        "action": "FailIndex",
        "onExitCodes": {"containerName": job_render.CONTAINER, "operator": "In", "values": [2, 3]},
    }
    assert job_render.FINAL_EXIT_CODES == [EXIT_EMBED_USAGE, EXIT_EMBED_FINAL]  # bad flags; cannot succeed as given
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    every = job(JOB_FEATURES["every option"])["spec"]
    assert (every["parallelism"], every["backoffLimitPerIndex"], every["maxFailedIndexes"]) == (4, 5, 2)
    assert job({**BASE, "shards": 3, "parallelism": 8})["spec"]["parallelism"] == 3


def test_the_command_is_the_corpus_commands_interface() -> None:
    server = container(BASE)
    assert server["command"] == ["python", "-m", "kembed.client", "embed"]
    assert server["args"] == [
        "--target",
        f"bge.search.svc.cluster.local:{GRPC_PORT}",
        "--input=/data/corpora/wiki/texts.txt",
        "--output=/data/vectors/wiki/emb.npy",
        "--format",
        "npy",
        "--shard",
        "$(JOB_COMPLETION_INDEX)/16",
        "--priority",
        "batch",
        "--no-progress",
        "--summary-file",
        "/dev/termination-log",
    ]
    assert server["terminationMessagePath"] == "/dev/termination-log"
    assert server["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The kubelet expands $(JOB_COMPLETION_INDEX) only from the container's own variables.
    index = next(e for e in server["env"] if e["name"] == job_render.INDEX_VAR)
    path = f"metadata.annotations['{job_render.INDEX_ANNOTATION}']"
    assert index == {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": path}}}


def test_every_option_reaches_the_command() -> None:
    args = container(JOB_FEATURES["every option"])["args"]
    assert args[args.index("--dimensions") + 1] == "256"
    assert "--no-truncate" in args
    assert args[args.index("--priority") + 1] == "interactive"
    assert "--prompt-name=passage" in args
    assert args[args.index("--format") + 1] == "jsonl"  # the spec's format wins over the extension
    jsonl = container(JOB_FEATURES["jsonl in, parquet out, one claim"])["args"]
    assert "--jsonl-field=body" in jsonl
    assert jsonl[jsonl.index("--format") + 1] == "parquet"
    flags = ("--dimensions", "--no-truncate", "--truncation-direction", "--prompt")
    assert not [arg for arg in container(BASE)["args"] if arg.startswith(flags)]


def test_the_truncation_direction_reaches_the_command_only_when_left() -> None:
    """The default renders no flag: a job that does not set it keeps the pod template it had."""
    left = container({**BASE, "truncationDirection": "left"})["args"]
    assert left[left.index("--truncation-direction") + 1] == "left"
    assert container({**BASE, "truncationDirection": "right"}) == container(BASE)
    assert "--truncation-direction" not in container(BASE)["args"]


def test_a_prompt_an_input_type_and_chunks_reach_the_command() -> None:
    literal = container({**BASE, "prompt": "-Represent: $(HOME) ", "chunk": True})["args"]
    assert "--prompt=-Represent: $$(HOME) " in literal  # a value, written as the author wrote it
    assert "--chunk" in literal and "--no-truncate" not in literal  # chunked, a long document is never cut
    none = container({**BASE, "prompt": "", "truncate": False})["args"]
    assert "--prompt=" in none and "--no-truncate" in none and "--chunk" not in none
    assert "--input-type=passage" in container({**BASE, "inputType": "passage"})["args"]


def test_claims_are_mounted_by_name_the_input_read_only() -> None:
    volumes, mounts = pod(BASE)["volumes"], container(BASE)["volumeMounts"]
    assert {"name": "claim-0", "persistentVolumeClaim": {"claimName": "corpora", "readOnly": True}} in volumes
    assert {"name": "claim-1", "persistentVolumeClaim": {"claimName": "vectors"}} in volumes
    assert {"name": "claim-0", "mountPath": "/data/corpora", "readOnly": True} in mounts
    assert {"name": "claim-1", "mountPath": "/data/vectors"} in mounts
    one = JOB_FEATURES["jsonl in, parquet out, one claim"]
    shared = [v for v in pod(one)["volumes"] if "persistentVolumeClaim" in v]
    assert shared == [{"name": "claim-0", "persistentVolumeClaim": {"claimName": "corpora"}}]  # writable: the parts
    assert {"name": "claim-0", "mountPath": "/data/corpora"} in container(one)["volumeMounts"]


def test_the_pods_are_locked_down_and_not_selected_by_any_server() -> None:
    rendered, server = pod(BASE), container(BASE)
    assert rendered["automountServiceAccountToken"] is False
    assert rendered["securityContext"]["runAsNonRoot"] is True
    assert rendered["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert server["securityContext"] == render.container_security()
    assert server["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    labels = job(BASE)["spec"]["template"]["metadata"]["labels"]
    # A server's Service, budget and NetworkPolicy select name=kembed, instance=NAME: never a job's pods.
    assert not render.selector_labels("wiki").items() <= labels.items()
    assert labels[identity.LABEL_MANAGED_BY] == identity.MANAGED_BY


def test_the_image_is_the_jobs_then_the_services_then_the_operators() -> None:
    assert container(BASE)["image"] == CONFIG.default_image
    own_server = job_render.Target("bge", "search", parse_spec({"image": "registry.example/kembed-server:8"}))
    assert container(BASE, own_server)["image"] == "registry.example/kembed-server:8"
    assert container({**BASE, "image": "registry.example/x:1"}, own_server)["image"] == "registry.example/x:1"


def test_pod_options_pass_through() -> None:
    spec = JOB_FEATURES["every option"]
    rendered = job(spec)["spec"]["template"]
    assert rendered["metadata"]["annotations"] == spec["podAnnotations"]
    assert rendered["spec"]["nodeSelector"] == spec["nodeSelector"]
    assert rendered["spec"]["tolerations"] == spec["tolerations"]
    assert rendered["spec"]["affinity"] == spec["affinity"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in rendered["spec"]["containers"][0]["env"]


def test_a_tls_service_is_called_with_its_ca_only() -> None:
    server = container(BASE, tls_target(secretName="bge-tls"))
    args = server["args"]
    assert args[args.index("--ca-file") + 1] == "/etc/kembed/server-ca/ca.crt"
    assert "--cert-file" not in args
    (ca,) = [v for v in pod(BASE, tls_target(secretName="bge-tls"))["volumes"] if "secret" in v]
    # Only ca.crt of the server's own Secret: never its private key.
    assert ca["secret"] == {
        "secretName": "bge-tls",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
        "defaultMode": 0o440,
    }
    assert {"name": ca["name"], "mountPath": "/etc/kembed/server-ca", "readOnly": True} in server["volumeMounts"]
    own_ca = pod({**BASE, "tls": {"caSecretName": "internal-ca"}}, tls_target(secretName="bge-tls"))
    assert [v["secret"]["secretName"] for v in own_ca["volumes"] if "secret" in v] == ["internal-ca"]
    assert "--ca-file" not in container(BASE)["args"]  # a plaintext service


def test_an_mtls_service_needs_the_jobs_client_certificate() -> None:
    mtls = tls_target(secretName="bge-tls", clientCASecretName="clients")
    with pytest.raises(InvalidSpec, match=r"spec\.tls\.clientSecretName: .*'clients'"):
        job(BASE, mtls)
    spec = {**BASE, "tls": {"clientSecretName": "wiki-client"}}
    args = container(spec, mtls)["args"]
    assert args[args.index("--cert-file") + 1] == "/etc/kembed/client-tls/tls.crt"
    assert args[args.index("--key-file") + 1] == "/etc/kembed/client-tls/tls.key"
    secrets = {v["secret"]["secretName"]: v["secret"]["items"] for v in pod(spec, mtls)["volumes"] if "secret" in v}
    assert secrets["wiki-client"] == [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]


def test_a_service_that_requires_a_key_is_called_with_its_secrets_key() -> None:
    keyed = job_render.Target("bge", "search", parse_spec({"apiKey": {"secretName": "bge-keys", "key": "keys"}}))
    client = container(BASE, keyed)
    assert client["args"][client["args"].index("--api-key-file") + 1] == "/etc/kembed/api-key/keys"
    (volume,) = [v for v in pod(BASE, keyed)["volumes"] if "secret" in v]
    assert volume["secret"] == {
        "secretName": "bge-keys",
        "items": [{"key": "keys", "path": "keys"}],
        "defaultMode": 0o440,
    }
    assert {"name": volume["name"], "mountPath": "/etc/kembed/api-key", "readOnly": True} in client["volumeMounts"]
    kubernetes_validate.validate(job(BASE, keyed), K8S_VERSIONS[-1], strict=True)
    assert "--api-key-file" not in container(BASE)["args"]  # a service without a key


def test_render_is_deterministic() -> None:
    spec = JOB_FEATURES["every option"]
    assert job(spec) == job(spec)


INVALID_JOBS: dict[str, tuple[dict[str, Any], str]] = {
    "no service": ({k: v for k, v in BASE.items() if k != "service"}, "spec.service"),
    "absolute input": ({**BASE, "input": {"claimName": "c", "path": "/etc/passwd"}}, "spec.input.path"),
    "input out of its claim": ({**BASE, "input": {"claimName": "c", "path": "a/../../b"}}, "spec.input.path"),
    "output out of its claim": ({**BASE, "output": {"claimName": "c", "path": "../o.npy"}}, "spec.output.path"),
    "jsonl read as lines": ({**BASE, "input": {"claimName": "c", "path": "d.jsonl"}}, "set format: jsonl"),
    "an output format unknown": ({**BASE, "output": {"claimName": "c", "path": "o.csv"}}, "set format"),
    "more failures allowed than shards": ({**BASE, "shards": 2, "retry": {"maxFailedShards": 3}}, "maxFailedShards"),
    "too many shards": ({**BASE, "shards": 10_001}, "spec.shards"),
    "two prompts": ({**BASE, "prompt": "query: ", "inputType": "query"}, "prompt and inputType: set at most one"),
    "an unknown input type": ({**BASE, "inputType": "question"}, "spec.inputType"),
    "TEI's spelling of a direction": ({**BASE, "truncationDirection": "Left"}, "spec.truncationDirection"),
    "a prompt longer than a request allows": ({**BASE, "prompt": "x" * 1025}, "spec.prompt"),
    "unknown field": ({**BASE, "replicas": 2}, "spec.replicas"),
}


@pytest.mark.parametrize(("spec", "needle"), INVALID_JOBS.values(), ids=INVALID_JOBS.keys())
def test_invalid_jobs_are_explained(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidSpec, match=needle.replace(".", r"\.")):
        parse_job_spec(spec)


def test_the_manifest_is_beside_the_parts() -> None:
    assert parse_job_spec(BASE).manifest_path == "wiki/emb.manifest.json"
