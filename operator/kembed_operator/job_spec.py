"""The EmbeddingJob spec as typed, checked values (pure), and the CRD's schema source for it.

An EmbeddingJob embeds a corpus on a PersistentVolumeClaim with an EmbeddingService of its
namespace, in ``shards`` parts that run as the indexes of one Indexed Job (:mod:`kembed_operator.job_render`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import Field, model_validator

from kembed.domain.prompts import MAX_PROMPT_CHARS
from kembed_operator.spec import PodOptions, PromptName, Quantity, RelativePath, SpecModel, parse

# Part names carry the index in five digits (`emb.part-00003-of-00016.npy`), and the operator keeps
# a few hundred bytes of every pod of a running job: ten thousand keeps both well within reach.
MAX_SHARDS = 10_000
# The most dimensions a job may ask for: more than any model served has (the largest common ones
# have 4,096). Within it, more than the service's model has fails the shards at once (exit 3).
MAX_DIMENSIONS = 8192
# What the corpus command writes, by the output file's extension.
OUTPUT_FORMATS = {".npy": "npy", ".jsonl": "jsonl", ".parquet": "parquet"}


class ClaimPath(SpecModel):
    claim_name: str = Field(min_length=1, description="A PersistentVolumeClaim in the EmbeddingJob's namespace.")
    path: RelativePath = Field(min_length=1, description="A file inside the claim, relative to its root.")


class JobInput(ClaimPath):
    format: Literal["lines", "jsonl"] = Field(
        "lines", description="lines: one text per line; jsonl: one JSON object per line, its jsonlField embedded."
    )
    jsonl_field: str = Field("text", min_length=1, description="With format jsonl: the field embedded.")


class JobOutput(ClaimPath):
    format: Literal["npy", "jsonl", "parquet"] | None = Field(
        None,
        description="Unset = from the path's extension (.npy, .jsonl, .parquet). Part i is written beside it as "
        "NAME.part-IIIII-of-NNNNN.EXT, and NAME.manifest.json lists the parts in order once all are done.",
    )


class JobResources(SpecModel):
    cpu: Quantity = "1"
    memory: Quantity = "2Gi"


class JobTls(SpecModel):
    """How the pods trust a service that serves TLS (its spec.tls), and prove who they are to one that requires mTLS."""

    ca_secret_name: str = Field(
        "",
        description="A Secret whose ca.crt signs the service's certificate; empty = the ca.crt of the service's own "
        "TLS Secret (cert-manager writes one). Only ca.crt is mounted.",
    )
    client_secret_name: str = Field(
        "",
        description="A kubernetes.io/tls Secret (tls.crt, tls.key) signed by the CA the service's mTLS trusts; "
        "required when the service sets tls.clientCASecretName.",
    )


class RetrySpec(SpecModel):
    per_shard: int = Field(
        3,
        ge=0,
        le=100,
        description="Retries of a shard whose pod failed (the Job's backoffLimitPerIndex); a retried shard resumes "
        "from the rows it had committed.",
    )
    max_failed_shards: int | None = Field(
        None,
        ge=0,
        le=MAX_SHARDS,
        description="Once more shards than this have failed for good, the job stops (the Job's maxFailedIndexes); "
        "unset = every shard runs to its end.",
    )


class EmbeddingJobSpec(PodOptions):
    service: str = Field(
        min_length=1,
        description="The EmbeddingService (same namespace) the pods call; the job waits until it is Ready.",
    )
    input: JobInput
    output: JobOutput
    shards: int = Field(
        1,
        ge=1,
        le=MAX_SHARDS,
        description="How many parts: shard i is a byte range of the input aligned to line starts, so no pod reads "
        "what is not its own.",
    )
    parallelism: int | None = Field(None, ge=1, le=MAX_SHARDS, description="Pods at once; unset = shards.")
    dimensions: int = Field(
        0,
        ge=0,
        le=MAX_DIMENSIONS,
        description="Truncate the vectors to this many dimensions; 0 = the model's. More than the model has fails "
        "every shard at once.",
    )
    truncate: bool = Field(True, description="Cut documents longer than the model's limit; false: such a line fails.")
    truncation_direction: Literal["right", "left"] = Field(
        "right",
        description="Which end truncate cuts (--truncation-direction): right keeps a document's start, left its end "
        "(its last tokens). With truncate false or chunk it changes nothing.",
    )
    priority: Literal["batch", "interactive"] = Field(
        "batch", description="The requests' class: batch lets the service's queries go first."
    )
    prompt_name: PromptName | None = Field(
        None,
        description="One of the model's prompts, put before each document (the corpus command's --prompt-name); "
        "unset = the model's default prompt, if any. One the model does not have fails every shard at once.",
    )
    prompt: str | None = Field(
        None,
        max_length=MAX_PROMPT_CHARS,
        description='A prompt\'s text itself, put before each document (--prompt); "" for none, even where the '
        "model has a default. At most one of promptName, prompt and inputType.",
    )
    input_type: Literal["query", "passage", "document"] | None = Field(
        None, description="The model's prompt for that side (--input-type): passage and document are one side."
    )
    chunk: bool = Field(
        False,
        description="Embed a document longer than the model's limit as chunks, their vectors averaged (--chunk); "
        "truncate then does not apply.",
    )
    resources: JobResources = Field(default_factory=JobResources)
    image: str = Field("", description="The pods' image; empty = the service's server image, which has the client.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    tls: JobTls = Field(default_factory=JobTls)
    retry: RetrySpec = Field(default_factory=RetrySpec)

    @model_validator(mode="after")
    def _one_prompt(self) -> EmbeddingJobSpec:
        fields = {"promptName": self.prompt_name, "prompt": self.prompt, "inputType": self.input_type}
        given = [name for name, value in fields.items() if value is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: set at most one of promptName, prompt and inputType")
        return self

    @model_validator(mode="after")
    def _shards_bound_the_rest(self) -> EmbeddingJobSpec:
        failed = self.retry.max_failed_shards
        if failed is not None and failed > self.shards:
            raise ValueError(f"retry.maxFailedShards ({failed}) is more than shards ({self.shards})")
        return self

    @model_validator(mode="after")
    def _formats_fit_the_paths(self) -> EmbeddingJobSpec:
        if self.input.format == "lines" and self.input.path.endswith(".jsonl"):
            raise ValueError("input: a .jsonl file read as lines would be read as JSONL: set format: jsonl")
        if self.output.format is None and PurePosixPath(self.output.path).suffix not in OUTPUT_FORMATS:
            raise ValueError(f"output: set format, or name the file with one of {', '.join(OUTPUT_FORMATS)}")
        return self

    @property
    def output_format(self) -> str:
        return self.output.format or OUTPUT_FORMATS[PurePosixPath(self.output.path).suffix]

    @property
    def pods_at_once(self) -> int:
        return min(self.shards, self.parallelism or self.shards)

    @property
    def manifest_path(self) -> str:
        """Where the corpus command writes the parts' manifest, inside the output claim."""
        path = PurePosixPath(self.output.path)
        return str(path.with_name(f"{path.stem}.manifest.json"))


def parse_job_spec(raw: dict[str, Any]) -> EmbeddingJobSpec:
    return parse(EmbeddingJobSpec, raw)
