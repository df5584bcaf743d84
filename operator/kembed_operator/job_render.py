"""An EmbeddingJob in, its Indexed Job out (pure: no I/O, no clock).

One Job with ``completionMode: Indexed``: index *i* runs the corpus command on shard *i* of the
input, writing part *i* of the output, against the service's in-cluster gRPC address (with TLS
when the service serves it, its API key when it requires one). The command is the client's
fixed interface (``python -m kembed.client embed ... --shard $(JOB_COMPLETION_INDEX)/N
--summary-file /dev/termination-log``); the kubelet expands ``$(JOB_COMPLETION_INDEX)`` from the
container's variables, and the summary the command writes at exit becomes the pod's termination
message, which the status reads for its rows.

Retries are the Job API's own, per index (``backoffLimitPerIndex``, ``maxFailedIndexes``,
``podFailurePolicy``, ``podReplacementPolicy``: Kubernetes 1.30 or later, docs/corpus-jobs.md). A
retried shard resumes from what its part had committed, and no two pods of one index run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kembed.contract import EXIT_EMBED_FINAL, EXIT_EMBED_USAGE
from kembed_operator import access, identity, kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import EmbeddingJobSpec
from kembed_operator.kinds import Manifest
from kembed_operator.spec import EmbeddingServiceSpec

CONTAINER = "embed"
COMMAND = ["python", "-m", "kembed.client", "embed"]
DATA_DIR = "/data"  # each claim is mounted at /data/<claimName>
TERMINATION_LOG = "/dev/termination-log"
INDEX_VAR = "JOB_COMPLETION_INDEX"
# Where the Job controller writes a pod's index (every supported version; the label came in 1.28).
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# The EmbeddingJob generation a Job was made from: a Job's pod template cannot change afterwards.
GENERATION_ANNOTATION = f"{identity.GROUP}/generation"
# The command's exit codes after which running it again cannot help: bad flags, and a run that
# cannot succeed as given (a bad input line, dimensions the model lacks, a read-only output).
FINAL_EXIT_CODES = [EXIT_EMBED_USAGE, EXIT_EMBED_FINAL]
COMPONENT = "embedding-job"


@dataclass(frozen=True)
class Target:
    """The EmbeddingService a job calls."""

    name: str
    namespace: str
    spec: EmbeddingServiceSpec

    @property
    def address(self) -> str:
        return render.grpc_address(self.name, self.namespace)


def labels(name: str) -> dict[str, str]:
    """The Job's and its pods' labels: not the servers' (``app.kubernetes.io/name`` differs), so no
    server's Service, budget or PodMonitor selects a job's pods."""
    return {
        identity.LABEL_NAME: identity.JOB_APP_NAME,
        identity.LABEL_INSTANCE: name,
        identity.LABEL_COMPONENT: COMPONENT,
        identity.LABEL_MANAGED_BY: identity.MANAGED_BY,
    }


def image(spec: EmbeddingJobSpec, target: Target, config: OperatorConfig) -> str:
    """The job's image, else its service's (a server image holds the client), else the operator's default."""
    return spec.image or target.spec.image or config.default_image


def claim_path(claim_name: str, path: str) -> str:
    """Where a file on a claim is inside the pod."""
    return f"{DATA_DIR}/{claim_name}/{path}"


def render_job(
    owner: render.Owner, generation: int, spec: EmbeddingJobSpec, target: Target, config: OperatorConfig
) -> render.Desired:
    """The Job, or :class:`~kembed_operator.spec.InvalidSpec` when it could not reach the service."""
    tls_arguments, tls_volumes, tls_mounts = access.client_tls(spec.tls, target.spec)
    key_arguments, key_volumes, key_mounts = access.client_api_key(target.spec)
    volumes, mounts = _claims(spec)
    pod: Manifest = {
        "restartPolicy": "Never",  # a failed pod is a retry of its index, counted by the Job
        "automountServiceAccountToken": False,  # the client never calls the API
        "enableServiceLinks": False,
        "securityContext": {**render.pod_security(), "fsGroupChangePolicy": "OnRootMismatch"},
        "containers": [
            {
                "name": CONTAINER,
                "image": image(spec, target, config),
                "imagePullPolicy": spec.image_pull_policy,
                "command": COMMAND,
                "args": arguments(spec, target) + tls_arguments + key_arguments,
                "env": [
                    {
                        "name": INDEX_VAR,
                        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}},
                    },
                    {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
                    *(var.manifest() for var in spec.env),
                ],
                "resources": {
                    "requests": {"cpu": spec.resources.cpu, "memory": spec.resources.memory},
                    "limits": {"memory": spec.resources.memory},
                },
                "securityContext": render.container_security(),
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts, *tls_mounts, *key_mounts],
                "terminationMessagePath": TERMINATION_LOG,
                # A command that died before writing its summary leaves the end of its log instead.
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}, *volumes, *tls_volumes, *key_volumes],
    }
    optional = {
        "nodeSelector": spec.node_selector,
        "tolerations": [toleration.manifest() for toleration in spec.tolerations],
        "affinity": spec.affinity,
    }
    pod.update({key: value for key, value in optional.items() if value})
    job_spec: Manifest = {
        "completionMode": "Indexed",
        "completions": spec.shards,
        "parallelism": spec.pods_at_once,
        "backoffLimitPerIndex": spec.retry.per_shard,
        # A replacement starts only once the failed pod is gone: never two writers of one part.
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailIndex",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": FINAL_EXIT_CODES},
                },
                # A pod evicted or preempted has not failed its shard: no retry spent.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": {
            "metadata": {"labels": labels(owner.name), "annotations": dict(spec.pod_annotations)},
            "spec": pod,
        },
    }
    if spec.retry.max_failed_shards is not None:
        job_spec["maxFailedIndexes"] = spec.retry.max_failed_shards
    metadata = render.owned_metadata(owner, labels(owner.name), annotations={GENERATION_ANNOTATION: str(generation)})
    return render.Desired(
        {"apiVersion": kinds.JOB.api_version, "kind": kinds.JOB.kind, "metadata": metadata, "spec": job_spec}
    )


def arguments(spec: EmbeddingJobSpec, target: Target) -> list[str]:
    """The corpus command's arguments for every index (TLS aside). What the resource's author wrote
    goes in as ``--flag=value``, ``$`` doubled: a value that starts with ``-`` stays a value, and a
    ``$(VAR)`` in it stays text instead of being expanded by the kubelet from the pod's variables."""
    args = ["--target", target.address, _option("--input", claim_path(spec.input.claim_name, spec.input.path))]
    if spec.input.format == "jsonl":
        args.append(_option("--jsonl-field", spec.input.jsonl_field))
    args += [_option("--output", claim_path(spec.output.claim_name, spec.output.path)), "--format", spec.output_format]
    args += ["--shard", f"$({INDEX_VAR})/{spec.shards}", "--priority", spec.priority]
    if spec.dimensions:
        args += ["--dimensions", str(spec.dimensions)]
    if spec.chunk:
        args.append("--chunk")
    elif not spec.truncate:
        args.append("--no-truncate")
    if spec.truncation_direction != "right":  # the default's pods keep the command they had
        args += ["--truncation-direction", spec.truncation_direction]
    if spec.prompt_name:
        args.append(_option("--prompt-name", spec.prompt_name))
    if spec.prompt is not None:
        args.append(_option("--prompt", spec.prompt))
    if spec.input_type:
        args.append(_option("--input-type", spec.input_type))
    return [*args, "--no-progress", "--summary-file", TERMINATION_LOG]


def _option(flag: str, authored: str) -> str:
    return f"{flag}={authored.replace('$', '$$')}"


def _claims(spec: EmbeddingJobSpec) -> tuple[list[Manifest], list[Manifest]]:
    """A volume per claim; the input's read-only unless the output is on the same claim."""
    writable = {spec.output.claim_name}
    claims = list(dict.fromkeys([spec.input.claim_name, spec.output.claim_name]))
    volumes, mounts = [], []
    for index, claim in enumerate(claims):
        read_only = claim not in writable
        source: Manifest = {"claimName": claim, **({"readOnly": True} if read_only else {})}
        volumes.append({"name": f"claim-{index}", "persistentVolumeClaim": source})
        mount: Manifest = {"name": f"claim-{index}", "mountPath": f"{DATA_DIR}/{claim}"}
        mounts.append({**mount, "readOnly": True} if read_only else mount)
    return volumes, mounts
