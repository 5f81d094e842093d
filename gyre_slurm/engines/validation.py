"""The engine's request bodies as pydantic models: SGLang's /generate body (GenerateReqInput) with its
sampling_params (SamplingParams), and the control routes' bodies.

A body is checked completely before the engine sees it. Types are strict (no "1" for 1, no true for 1, no NaN);
null means the default, as in SGLang. A field SGLang has but this engine does not implement is accepted only at
SGLang's default value, never silently ignored; an unknown field is refused. A bad body is a 400 whose message
starts with the field's place, e.g. "sampling_params.top_p: Input should be greater than 0". Checks that need the
model (vocabulary, context length, tokenizer) run after parsing, in `parse_generate`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gyre_slurm.engines.errors import bad_request
from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.transfer.kv import KVHandle

MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]  # cuda_graph is accepted and means nothing on CPU
MEMORY_TAGS: tuple[str, ...] = get_args(MemoryTag)


class OnlyDefault:
    """Annotated marker: a field SGLang has that this engine takes only at its default value."""


Unsupported = Annotated[Any, OnlyDefault()]


def _version_str(v: Any) -> Any:
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


# SGLang's weight versions are strings; clients also send the integer version
Version = Annotated[str, BeforeValidator(_version_str)]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    NULL_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset()  # fields where null means something else than absent

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.NULL_IS_A_VALUE}
        return data

    @field_validator("*")
    @classmethod
    def _only_default(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields[info.field_name or ""]
        if value != field.default and any(isinstance(m, OnlyDefault) for m in field.metadata):
            raise PydanticCustomError("unsupported", "{value} is not supported by the embedded engine (only the "
                                      "default, {default})", {"value": repr(value), "default": repr(field.default)})
        return value


@dataclass(frozen=True)
class Sampling:
    """A request's sampling, resolved: every value concrete, checked against the model's limits."""

    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # -1 = whole vocabulary
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    no_stop_trim: bool
    skip_special_tokens: bool
    seed: int | None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


class SamplingParamsBody(Body):
    """SGLang's sampling_params (sglang/srt/sampling/sampling_params.py)."""

    NULL_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset({"max_new_tokens"})  # null: up to the context

    max_new_tokens: int | None = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    n: Unsupported = 1
    min_p: Unsupported = 0.0
    frequency_penalty: Unsupported = 0.0
    presence_penalty: Unsupported = 0.0
    repetition_penalty: Unsupported = 1.0
    min_new_tokens: Unsupported = 0
    json_schema: Unsupported = None
    regex: Unsupported = None
    ebnf: Unsupported = None
    structural_tag: Unsupported = None
    stop_regex: Unsupported = None
    logit_bias: Unsupported = None
    custom_params: Unsupported = None
    stream_interval: Unsupported = None
    spaces_between_special_tokens: Unsupported = True

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 1 and v != -1:
            raise PydanticCustomError("top_k", "must be -1 (the whole vocabulary) or at least 1, got {v}", {"v": v})
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return ([v] if v else []) if isinstance(v, str) else v

    def resolve(self, prompt_len: int, context_len: int, has_tokenizer: bool) -> Sampling:
        max_new = max(context_len - prompt_len - 1, 0) if self.max_new_tokens is None else self.max_new_tokens
        if self.stop and not has_tokenizer:
            raise bad_request(f"sampling_params.stop: {self.stop!r} needs a tokenizer, and the model folder has no "
                              "tokenizer.json")
        if max_new + prompt_len >= context_len:  # SGLang's rule and wording (tokenizer_manager._validate_one_request)
            raise bad_request(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You "
                f"requested a total of {max_new + prompt_len} tokens: {prompt_len} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                f"or the completion to fit within the limit.")
        return Sampling(max_new, self.temperature, self.top_p, self.top_k, tuple(self.stop),
                        frozenset(self.stop_token_ids), self.ignore_eos, self.no_stop_trim, self.skip_special_tokens,
                        self.sampling_seed)


class GenerateBody(Body):
    """SGLang's GenerateReqInput, as far as this engine serves it: one sequence of input_ids, not streamed."""

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    rid: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1)
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: Unsupported = False
    text: Unsupported = None  # the engine takes token ids; the proxy tokenizes
    logprob_start_len: Unsupported = -1
    top_logprobs_num: Unsupported = 0
    token_ids_logprob: Unsupported = None
    return_hidden_states: Unsupported = False
    lora_path: Unsupported = None
    image_data: Unsupported = None
    input_embeds: Unsupported = None
    custom_logit_processor: Unsupported = None
    data_parallel_rank: Unsupported = None
    session_params: Unsupported = None
    bootstrap_host: Unsupported = None
    # accepted and ignored: nothing a client can observe depends on them here
    log_metrics: Any = None
    priority: Any = None
    background: Any = None
    return_prompt_token_ids: Any = None

    @field_validator("input_ids", mode="before")
    @classmethod
    def _one_sequence(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], list):
            raise PydanticCustomError("batched", "batched input_ids are not supported: send one sequence per request")
        return v


@dataclass(frozen=True)
class GenerateInput:
    input_ids: list[int]
    sampling: Sampling
    rid: str
    return_logprob: bool
    return_text_in_logprobs: bool


def parse_generate(raw: Any, vocab_size: int, context_len: int, has_tokenizer: bool) -> GenerateInput:
    """A /generate body, validated and checked against the model's vocabulary and context length."""
    body = validate(GenerateBody, raw)
    ids = body.input_ids
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise bad_request(f"input_ids contain token ids outside the vocabulary [0, {vocab_size})")
    if len(ids) >= context_len:
        raise bad_request(f"The input ({len(ids)} tokens) is longer than the model's context length "
                          f"({context_len} tokens).")
    sampling = body.sampling_params.resolve(len(ids), context_len, has_tokenizer)
    return GenerateInput(ids, sampling, body.rid, body.return_logprob, body.return_text_in_logprobs)


# --- control routes ----------------------------------------------------------------------------------------------

class ControlBody(Body):
    # SGLang's clients send fields (is_async, torch_empty_cache, ...) that change nothing here
    model_config = ConfigDict(extra="ignore")


class UpdateWeightsBody(ControlBody):
    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors"] = "auto"
    weight_version: Version | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightsFromTransferEngineBody(ControlBody):
    """gyre's own route (SGLang pulls weights over the Transfer Engine only at start, remote_instance): pull a
    version the core published (its parts: protocol.WeightsRef.parts) and serve it."""

    parts: list[WeightsHandle] = Field(min_length=1)
    weight_version: Version | None = None
    flush_cache: bool = True
    model_path: str | None = None  # the version's snapshot folder: what a resume after a release reloads


class MemoryBody(ControlBody):
    tags: list[MemoryTag] | None = None  # None: all of them


class AbortBody(ControlBody):
    rid: str | None = None
    abort_all: bool = False
    export_kv: bool = False  # gyre's: the abort answers carry a KV handle (transfer/kv.py) to continue elsewhere


class ImportKvBody(ControlBody):
    """gyre's POST /import_kv: the KV handle of an abort answer and the ids of the call it continues (they start
    with the ids the handle covers)."""

    kv_handle: KVHandle
    input_ids: list[int] = Field(min_length=1)


class ReleaseKvExportBody(ControlBody):
    id: str = Field(min_length=1)


class PauseBody(ControlBody):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    export_kv: bool = False  # gyre's, with mode abort: as AbortBody's


class WeightVersionBody(ControlBody):
    new_version: Version
    abort_all_requests: bool = False


class InitWeightsGroupBody(ControlBody):
    """SGLang's InitWeightsUpdateGroupReqInput: the trainer is rank 0 and hosts the store; this engine (one rank)
    is rank_offset."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsGroupBody:
        if self.rank_offset >= self.world_size:
            raise PydanticCustomError("rank", "rank_offset {r} is outside world_size {w}",
                                      {"r": self.rank_offset, "w": self.world_size})
        return self


class DistributedUpdateBody(ControlBody):
    """SGLang's UpdateWeightsFromDistributedReqInput: one bucket, broadcast by rank 0 in this order."""

    names: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Version | None = None
    load_format: Unsupported = None

    @model_validator(mode="after")
    def _one_entry_per_name(self) -> DistributedUpdateBody:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise PydanticCustomError("lengths", "names, dtypes and shapes differ in length ({n}, {d}, {s})",
                                      {"n": len(self.names), "d": len(self.dtypes), "s": len(self.shapes)})
        if len(set(self.names)) != len(self.names):
            raise PydanticCustomError("names", "names repeat a parameter")
        return self


class DestroyWeightsGroupBody(ControlBody):
    group_name: str = "weight_update_group"


class BeginWeightUpdateBody(ControlBody):
    """SGLang's BeginWeightUpdateReqInput (managers/io_struct.py): the runners a session covers (target, draft or
    both); this engine has one model, the target."""

    selector: Literal["all", "target", "draft"] = "all"


# --- reading a body ----------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def parse_json(raw: bytes, required: bool = True) -> dict[str, Any]:
    """A request body as a JSON object; an empty body is {} where the route takes one."""
    if not raw.strip():
        if required:
            raise bad_request("the request needs a JSON body")
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def validate(model: type[M], raw: Any) -> M:
    """`raw` as `model`, or a 400 naming every bad field ("sampling_params.top_p: ...")."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(step) for step in err['loc']) or 'body'}: "
                    f"{'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}"
                    for err in exc.errors(include_url=False)]
        raise bad_request("; ".join(problems)) from None
