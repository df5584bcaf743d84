"""Server settings: field ``x`` is read from ``KEMBED_X`` and validated at start-up (a bad value is
a :class:`~kembed.config.values.ConfigError` naming the variable). Each field is in a
:class:`~kembed.config.values.Group`, by which the tables are generated (:mod:`kembed.config.table`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kembed.config.env import env_list, read_env
from kembed.config.values import (
    MAX_FRONTENDS,
    OPERATOR,
    TUNING,
    USER,
    Admission,
    Batching,
    Dtype,
    Graphs,
    Pooling,
    Toggle,
    Warmup,
    available_cpus,
    frontends_for,
)
from kembed.contract import ENV_PREFIX, GRPC_PORT, HTTP_PORT, OPERATOR_ENV_PREFIX, REST_ANY_PORT, REST_PORT, env_name
from kembed.domain.prompts import name_problem, problem


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

    # --- what a user sets: the model ---
    model: str = Field(
        "",
        description="Model folder, or a Hugging Face hub id; empty = the bundled all-MiniLM-L6-v2",
        json_schema_extra=USER,
    )
    model_revision: str = Field(
        "", description="Hub revision (branch, tag or commit) when `model` is a hub id", json_schema_extra=USER
    )
    model_cache_dir: str = Field(
        "", description="Hub cache folder (HF_HUB_CACHE semantics); empty = the hub default", json_schema_extra=USER
    )
    trust_remote_code: bool = Field(
        False, description="Allow model code from the model folder (off: never run it)", json_schema_extra=USER
    )
    pooling: Pooling = Field(
        Pooling.AUTO,
        description="auto (from the sentence-transformers config), mean, cls or last",
        json_schema_extra=USER,
    )
    control_tokens: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Tokens left out of pooling: comma-separated (`[query],[title]`) or a JSON list, which may "
        'hold commas and spaces (`["[query]", ","]`)',
        json_schema_extra=USER,
    )
    max_input_tokens: int = Field(
        0, ge=0, description="Longest input in tokens; 0 = the model's limit", json_schema_extra=USER
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N", json_schema_extra=USER)
    served_model_name: str = Field(
        "",
        description="The name clients give as `model` (REST requests, first in /v1/models, gRPC Info's "
        "`served_model_name`), e.g. a hub id for a model served from a folder; the model id is accepted too; "
        "empty = the model id only",
        json_schema_extra=USER,
    )
    prompts: dict[str, str] | None = Field(
        None,
        description='The model\'s prompts by name, a JSON object (`{"query": "query: "}`), in place of '
        "those of its folder's config_sentence_transformers.json; unset = the folder's",
        json_schema_extra=USER,
    )
    default_prompt_name: str = Field(
        "",
        description="The prompt put before a text whose request picks none; empty = the folder's "
        "`default_prompt_name`, if any",
        json_schema_extra=USER,
    )

    # --- what a user sets: binds and ports, TLS, logging ---
    grpc_host: str = Field(
        "127.0.0.1",
        description="gRPC and REST bind address; `::` is both IPv6 and IPv4 (containers set it)",
        json_schema_extra=USER,
    )
    grpc_port: int = Field(
        GRPC_PORT, ge=0, le=65535, description="gRPC port (0 = any free port)", json_schema_extra=USER
    )
    rest_port: int = Field(
        REST_PORT,
        ge=REST_ANY_PORT,
        le=65535,
        description=f"OpenAI-compatible REST port (/v1/embeddings, /v1/models); 0 = off, {REST_ANY_PORT} = any free "
        "port",
        json_schema_extra=USER,
    )
    http_host: str = Field(
        "127.0.0.1",
        description="Health and metrics bind address; `::` is both IPv6 and IPv4 (containers set it)",
        json_schema_extra=USER,
    )
    http_port: int = Field(
        HTTP_PORT, ge=0, le=65535, description="Health and metrics port (0 = any free port)", json_schema_extra=USER
    )
    # TLS: the gRPC and REST ports only; the HTTP port stays plaintext for kubelet probes.
    tls_cert_file: str = Field(
        "",
        description="PEM certificate chain: with the key, the gRPC port serves TLS only; re-read when it changes",
        json_schema_extra=USER,
    )
    tls_key_file: str = Field("", description="PEM private key of `KEMBED_TLS_CERT_FILE`", json_schema_extra=USER)
    tls_client_ca_file: str = Field(
        "", description="PEM CA bundle: mTLS, every client must present a certificate it signed", json_schema_extra=USER
    )
    api_key_file: str = Field(
        "",
        description="File of API keys, one a line (several while one is rotated), read at start: every REST and "
        "gRPC call must then present one (`Authorization: Bearer KEY`; docs/api.md#authentication); empty = none",
        json_schema_extra=USER,
    )
    log_level: str = Field("INFO", description="Python log level (DEBUG, INFO, WARNING, ERROR)", json_schema_extra=USER)

    # --- what a user sets: the latency targets ---
    max_drain_ms: float = Field(
        2000.0,
        gt=0,
        description="Throughput: reject when a request could wait longer than this (2x the drain time with buckets)",
        json_schema_extra=USER,
    )
    p95_soft_ms: float = Field(
        1500.0, gt=0, description="Latency: above this P95, shed a growing fraction of requests", json_schema_extra=USER
    )
    p95_hard_ms: float = Field(
        3000.0, gt=0, description="Latency: above this P95, reject every request", json_schema_extra=USER
    )
    default_timeout_ms: float = Field(
        30_000.0,
        gt=0,
        description="Deadline for requests that set none; longer for one whose own work takes longer at the rate",
        json_schema_extra=USER,
    )

    # --- tuning: the model's run ---
    dtype: Dtype = Field(
        Dtype.AUTO,
        description="auto (bf16 on CUDA; on a CPU with bf16 units, bf16 if warmup measures it faster and "
        "accurate, else fp32), float32, float16 or bfloat16",
        json_schema_extra=TUNING,
    )
    compile: Toggle = Field(
        Toggle.AUTO,
        description="torch.compile: auto = CUDA graphs on CUDA; on a CPU, inductor if warmup measures it faster "
        "and accurate, else eager (docs/decisions/cpu-compile.md)",
        json_schema_extra=TUNING,
    )
    graphs: Graphs = Field(
        Graphs.CAPTURE,
        description="When compiling: capture or static (on a CPU: static, fixed shapes; capture, one dynamic compile)",
        json_schema_extra=TUNING,
    )
    warmup: Warmup = Field(
        Warmup.AUTO,
        description="auto, grid or largest (docs/configuration.md); compiled, always grid",
        json_schema_extra=TUNING,
    )

    # --- tuning: batching ---
    batching: Batching = Field(
        Batching.TOKEN_BUCKET, description="token_bucket, or naive (the ablation baseline)", json_schema_extra=TUNING
    )
    buckets: list[int] = Field(
        default_factory=lambda: [16, 32, 64, 128, 256, 512],
        description="Bucket lengths in tokens, ascending; clipped to the model's max input tokens",
        json_schema_extra=TUNING,
    )
    max_batch_size: int = Field(
        64,
        ge=1,
        le=4096,
        description="Most rows in one batch (batch shapes are powers of two up to it)",
        json_schema_extra=TUNING,
    )
    max_tokens_per_batch: int = Field(
        0,
        ge=0,
        description="Most padded tokens (rows x length) in one batch; 0 = 2048 on CPU, 16384 on CUDA",
        json_schema_extra=TUNING,
    )
    max_wait_ms: float = Field(
        20.0,
        ge=0,
        description="A bucket whose oldest item waited this long is stale and drains first",
        json_schema_extra=TUNING,
    )
    frame_interval_ms: float = Field(
        2.0,
        ge=0,
        le=100,
        description=(
            "Once calls overlap, a front end sends the engine a frame of requests per interval (0 = per turn),"
            " each once the engine has taken the last"
        ),
        json_schema_extra=TUNING,
    )

    # --- tuning: admission ---
    admission: list[Admission] = Field(
        default_factory=lambda: [Admission.THROUGHPUT, Admission.LATENCY],
        description="Strategies, comma-separated (throughput, latency), or empty for none",
        json_schema_extra=TUNING,
    )
    latency_window_s: float = Field(10.0, gt=0, description="Sliding window for the P95", json_schema_extra=TUNING)
    demand_window_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="Time constant of kembed_demand_ratio's weighting (reaches 63% of a step in it); "
        "the capacity it divides by forgets a best rate over 60 of them",
        json_schema_extra=TUNING,
    )
    max_queued_tokens: int = Field(
        262144,
        ge=1,
        description="Hard cap on queued padded tokens, whatever else says (interactive work may go 1/8 over it)",
        json_schema_extra=TUNING,
    )

    # --- tuning: request limits and serving ---
    max_items_per_request: int = Field(
        2048, ge=1, description="Most texts or sequences in one request (OpenAI's 2,048)", json_schema_extra=TUNING
    )
    max_text_chars: int = Field(
        100_000,
        ge=1,
        description="Longest text in characters (bounds tokenization work); cut to it with truncate",
        json_schema_extra=TUNING,
    )
    chunk_long_inputs: bool = Field(
        False,
        description="Embed an input longer than the model's limit as chunks of the model's length, their "
        "vectors averaged by their tokens, where a request sets neither `chunk` nor `truncate` (docs/api.md)",
        json_schema_extra=USER,
    )
    max_chunks_per_input: int = Field(
        16,
        ge=1,
        description="Most chunks one input is embedded as, with `chunk` (16: 4,066 tokens for all-MiniLM-L6-v2); "
        "a text is still at most KEMBED_MAX_TEXT_CHARS characters",
        json_schema_extra=TUNING,
    )
    max_message_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        description="Largest request: a gRPC message or a REST body (answers may be up to 32 MiB)",
        json_schema_extra=TUNING,
    )
    max_concurrent_rpcs: int = Field(
        1024,
        ge=1,
        description="gRPC calls handled at once, lowered to what the memory budget holds of the largest "
        "(docs/operations.md); beyond it a call is RESOURCE_EXHAUSTED with a pushback. A paced refusal holds none",
        json_schema_extra=TUNING,
    )
    max_rest_connections: int = Field(
        1024,
        ge=1,
        description="Open REST connections per front end, lowered to half the file descriptors it may "
        "open; past it one of the client holding the most is closed",
        json_schema_extra=TUNING,
    )
    refusal_rate: float = Field(
        500.0,
        gt=0,
        description="Refusals a second one client (a gRPC connection, a REST address) has answered at once past "
        "its refusal burst; later ones are answered when its rate allows (docs/admission.md)",
        json_schema_extra=TUNING,
    )
    refusal_burst: int = Field(
        1000,
        ge=1,
        description="Refusals one client has answered at once before its refusal rate applies",
        json_schema_extra=TUNING,
    )
    max_connection_age_ms: int = Field(
        10_000,
        ge=1000,
        description="A connection's age, within 10%: then gRPC sends GOAWAY (calls in flight get the drain "
        "timeout to finish) and REST answers Connection: close, so clients connect again through the Service "
        "and a new replica gets traffic within one HPA sync (docs/decisions/connection-age.md)",
        json_schema_extra=TUNING,
    )
    compute_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to the compute threads (CPU inference) and to each front end's tokenizing "
        "threads, so serving (refusing, admitting, answering calls) preempts them",
        json_schema_extra=TUNING,
    )
    compute_lanes: int = Field(
        0,
        ge=0,
        le=64,
        description="CPU inference in eager mode: batches computed at once, each on its share of the compute "
        "threads; 0 = one per CPU (docs/decisions/compute-lanes.md). Compiled shapes and GPUs compute one",
        json_schema_extra=TUNING,
    )
    frontends: str = Field(
        "auto",
        description="gRPC front-end processes sharing the port: a number, or auto ((CPUs - 2) / 2, from 1 to 8)",
        json_schema_extra=TUNING,
    )

    # --- what the operator sets, from the pod it renders ---
    compile_cache_dir: str = Field(
        "",
        description="Folder kept across restarts for auto's verdicts (dtype, forward) and torch's compile caches "
        "(keyed by torch, CPU or GPU, model); empty = none (`make serve` sets `~/.cache/kembed`)",
        json_schema_extra=OPERATOR,
    )
    drain_timeout_s: float = Field(
        25.0, ge=0, description="On SIGTERM, how long accepted work may take to finish", json_schema_extra=OPERATOR
    )
    cpu_request_millicores: int = Field(
        0,
        ge=0,
        description="CPU request in millicores (the operator passes the container's down); caps auto's CPUs; 0 = none",
        json_schema_extra=OPERATOR,
    )
    memory_limit_bytes: int = Field(
        0,
        ge=0,
        description="The container's memory limit in bytes (the operator passes it down): a quarter of it is "
        "the front ends' memory budget (docs/operations.md); 0 = the cgroup's limit, else the machine's memory",
        json_schema_extra=OPERATOR,
    )

    @field_validator("control_tokens", "buckets", "admission", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        return env_list(value)

    @field_validator("prompts", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("prompts")
    @classmethod
    def _prompts_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (reason := problem(value, "")) is not None:
            raise ValueError(reason)
        return value

    @field_validator("default_prompt_name")
    @classmethod
    def _a_prompt_name(cls, value: str) -> str:
        if value and (reason := name_problem(value)) is not None:
            raise ValueError(reason)
        return value

    @field_validator("buckets")
    @classmethod
    def _buckets_ascending(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("needs at least one bucket length")
        if any(b < 1 for b in value) or value != sorted(set(value)):
            raise ValueError("bucket lengths must be positive, unique and ascending")
        return value

    @field_validator("grpc_host", "http_host")
    @classmethod
    def _unbracketed(cls, value: str) -> str:
        """``[::1]``, as URLs write it, is the address ``::1``."""
        return value[1:-1] if value.startswith("[") and value.endswith("]") else value

    @field_validator("log_level")
    @classmethod
    def _log_level_known(cls, value: str) -> str:
        if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return value.upper()

    @field_validator("frontends")
    @classmethod
    def _frontends_known(cls, value: str) -> str:
        if value != "auto" and not (value.isdigit() and 1 <= int(value) <= MAX_FRONTENDS):
            raise ValueError(f"must be auto or a number from 1 to {MAX_FRONTENDS}")
        return value

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda") and not value.startswith("cuda:"):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.p95_soft_ms > self.p95_hard_ms:
            raise ValueError(f"{env_name('p95_soft_ms')} must not exceed {env_name('p95_hard_ms')}")
        if 0 < self.max_tokens_per_batch < self.buckets[0]:
            raise ValueError(f"{env_name('max_tokens_per_batch')} must hold one row of the smallest bucket")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(f"{env_name('tls_cert_file')} and {env_name('tls_key_file')} are set together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(f"{env_name('tls_client_ca_file')} needs {env_name('tls_cert_file')} (mTLS is TLS)")
        return self

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def connection_age_grace_ms(self) -> int:
        """How long a connection's calls may go on after its age's GOAWAY: the drain timeout."""
        return int(self.drain_timeout_s * 1000)

    def cpus(self) -> float:
        """The CPUs this server may use: what front ends and torch's threads are sized by."""
        return available_cpus(self.cpu_request_millicores)

    def frontend_count(self) -> int:
        """How many front ends: as set, or by the CPUs this process may use (docs/decisions/cpu-sizing.md)."""
        return int(self.frontends) if self.frontends != "auto" else frontends_for(self.cpus())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``KEMBED_*`` variables; unknown ``KEMBED_*`` names are an error (likely a typo), but
        ``KEMBED_OPERATOR_*`` are the operator's own, so a shell may hold both."""
        return read_env(cls, ENV_PREFIX, environ, overrides, besides=OPERATOR_ENV_PREFIX)
