"""The contract between the kembed server and everything around it.

Ports, probe paths, ``KEMBED_*`` variable names and metric names live here and nowhere else:
the server, the operator (which renders Deployments and HPAs against them), the Helm chart
tests and the benchmarks all read them from this module. It imports nothing heavy, so the
operator image can use it without torch.
"""

from typing import Final

GRPC_PORT: Final = 50051
HTTP_PORT: Final = 8001
REST_PORT: Final = 8080
# KEMBED_REST_PORT's "any free port": its 0 turns REST off. A port of 0 elsewhere is any free port.
REST_ANY_PORT: Final = -1
# The bind address of every address of both families (IPv4 alone where the host has no IPv6): what
# the operator's pods and the image listen on (kembed/plumbing/listen.py).
ANY_ADDRESS: Final = "::"

LIVEZ_PATH: Final = "/livez"
READYZ_PATH: Final = "/readyz"
# /health's forward_reason, ending so, while a CPU compiles its forward beside eager serving.
COMPILING: Final = "compiling while eager serves"
HEALTH_PATH: Final = "/health"
METRICS_PATH: Final = "/metrics"

ENV_PREFIX: Final = "KEMBED_"
# The operator's own variables: not server settings, so the server leaves them alone.
OPERATOR_ENV_PREFIX: Final = "KEMBED_OPERATOR_"

# Exit codes every process of the server uses, so the pod's last state says why it stopped.
EXIT_STARTUP_FAILED: Final = 1  # the model did not load, a port was taken
EXIT_CONFIG: Final = 2  # a KEMBED_* setting is invalid (the message names it)
EXIT_FATAL: Final = 70  # a process died or the device failed: Kubernetes restarts the pod

# The corpus command's exit codes (``python -m kembed.client embed``). An EmbeddingJob's pods fail
# their shard at once on the final ones, and retry it (resuming its part) on EXIT_EMBED_FAILED.
EXIT_EMBED_FAILED: Final = 1  # running it again may succeed: a server away too long, a full disk
EXIT_EMBED_USAGE: Final = 2  # bad flags (argparse's own code)
EXIT_EMBED_FINAL: Final = 3  # it cannot succeed as given: its input, a flag or its output must change
EXIT_EMBED_INTERRUPTED: Final = 130  # ^C or SIGTERM: the rows written are kept

GRPC_SERVICE: Final = "kembed.v1.Embedder"
# gRPC trailing metadata key telling a rejected client when to retry (gRFC A6).
RETRY_PUSHBACK_KEY: Final = "grpc-retry-pushback-ms"
# Retry markers: a call that carries one with a value over 0 is a retry, and is not counted again
# in the offered demand (kembed/policy/demand.py). gRPC's own retry policy sends the first (gRFC A6), the
# openai SDKs the second, kembed's client the third (gRPC metadata; a REST call may send it too).
GRPC_PREVIOUS_ATTEMPTS_KEY: Final = "grpc-previous-rpc-attempts"
OPENAI_RETRY_COUNT_HEADER: Final = "x-stainless-retry-count"
RETRY_ATTEMPT_KEY: Final = "kembed-retry-attempt"
# A call's id in the server's log lines: the caller's (a REST header, gRPC metadata), else one made;
# answered under the same key (REST: a header; gRPC: trailing metadata).
REQUEST_ID_KEY: Final = "x-request-id"


def env_name(setting: str) -> str:
    """The environment variable for a server setting: ``max_drain_ms`` -> ``KEMBED_MAX_DRAIN_MS``."""
    return ENV_PREFIX + setting.upper()


# The label that says which priority class a metric counts ("interactive" or "batch").
PRIORITY_LABEL: Final = "priority"


class Metric:
    """Prometheus metric names. The operator's autoscaling queries depend on them: keep them."""

    DEMAND_RATIO: Final = "kembed_demand_ratio"  # work offered, refused included, over the pod's capacity
    QUEUE_DRAIN_SECONDS: Final = "kembed_queue_drain_seconds"  # the whole backlog, every class
    LATENCY_P95_SECONDS: Final = "kembed_request_latency_p95_seconds"  # interactive requests
    REQUEST_DURATION_SECONDS: Final = "kembed_request_duration_seconds"  # {priority}
    REQUEST_STAGE_SECONDS: Final = "kembed_request_stage_seconds"  # {stage}: tokenize, queue, compute
    QUEUED_TOKENS: Final = "kembed_queued_tokens"  # queued or in flight, every class
    WAITING_TOKENS: Final = "kembed_waiting_tokens"  # {priority}: queued, not yet in a batch
    WAITING_REQUESTS: Final = "kembed_waiting_requests"  # {priority}: none of their items started
    RUNNING_REQUESTS: Final = "kembed_running_requests"  # some of their items started, not all answered
    PRIORITY_LATENCY_P95_SECONDS: Final = "kembed_priority_latency_p95_seconds"  # {priority}
    SATURATION: Final = "kembed_saturation"  # 0 to 1, of the admission budget
    SERVICE_RATE: Final = "kembed_service_rate_tokens_per_second"
    CAPACITY: Final = "kembed_capacity_tokens_per_second"
    REQUESTS: Final = "kembed_requests"  # exposed as kembed_requests_total{code}
    REJECTED: Final = "kembed_rejected"  # exposed as kembed_rejected_total{reason,priority}
    REFUSALS_PACED: Final = "kembed_refusals_paced"  # exposed as kembed_refusals_paced_total
    REFUSALS_SHARED: Final = "kembed_refusals_shared"  # exposed as ..._total
    DEMOTED: Final = "kembed_demoted"  # exposed as kembed_demoted_total
    BATCH_SIZE: Final = "kembed_batch_size"
    BATCH_TOKENS: Final = "kembed_batch_tokens"
    TOKENS: Final = "kembed_tokens"  # exposed as kembed_tokens_total{kind="real"|"padding"}
    INFERENCE_SECONDS: Final = "kembed_inference_seconds"
    WORKER_QUEUE_DEPTH: Final = "kembed_worker_queue_depth"
    READY: Final = "kembed_ready"
    STREAM_ANSWERS_DROPPED: Final = "kembed_stream_answers_dropped"  # exposed as ..._total
    CALLS_GONE: Final = "kembed_calls_gone"  # exposed as kembed_calls_gone_total{api}
    FRONTEND_STALLS: Final = "kembed_frontend_stalls"  # exposed as ..._total
    SERVING_DTYPE: Final = "kembed_serving_dtype"  # 1, labelled with the dtype served and why
    SERVING_FORWARD: Final = "kembed_serving_forward"  # 1, labelled with the forward served and why
