"""Request and response types of the OpenAI-compatible endpoint (pydantic v2), in the shape of vLLM's
and SGLang's ``protocol.py``: ``/v1/completions`` and ``/v1/chat/completions``, their streaming
chunks, errors and the model list.

Field types are strict (``"5"`` is not an integer, ``"true"`` not a boolean) and numbers finite
(``NaN`` / ``Infinity`` are refused). Unknown request fields are ignored, as vLLM and SGLang do (clients
send many), and logged with their names (:attr:`pydantic.BaseModel.model_extra`); fields this server
knows but cannot honour (``n`` > 1, ``echo``, penalties, ``logit_bias``, sampling, structured output
``response_format`` / ``guided_*`` / ``regex`` / ``json_schema`` / ``ebnf``, tool calling) are declared
here and refused with a 400 by the server (:mod:`impl.vskipper.api_server`), which also runs the checks
that need the engine (vocabulary, context length, ``max_logprobs``, served model name). Fields that do
not change a greedy decode (``top_p`` in (0, 1], ``top_k``, ``min_p``, ``seed``) are checked and accepted.

Extensions beyond the OpenAI API (as vLLM / SGLang spell them): ``ignore_eos``, ``skip_special_tokens``,
``request_id`` (alias ``rid``), ``generation_config`` (transformers-serve style), and in responses
``token_ids`` per choice, ``top_logprob_ids`` and the ``vskipper`` object (the request's engine id,
arm and modes).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictBool, StrictInt, StrictStr, model_validator

__all__ = [
    "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionStreamResponse", "ChatMessage",
    "CompletionRequest", "CompletionResponse", "CompletionStreamResponse", "ErrorResponse", "ModelCard",
    "ModelList", "StreamOptions", "UsageInfo",
]

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A finite JSON number (an integer or a float; not a string, a boolean, NaN or Infinity)."""

#: Structured-output fields of vLLM / SGLang (the server refuses them: it cannot constrain decoding).
STRUCTURED_OUTPUT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "regex",
                            "json_schema", "ebnf", "structural_tag")
#: Tool-calling fields of the OpenAI API (refused when set: the server has no tool parser).
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")


class _Request(BaseModel):
    # "allow" keeps unknown fields in ``model_extra`` so that the server can log their names; they
    # are never read.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with ``choices: []`` and ``usage`` (and
    ``"usage": null`` on every other chunk), as the OpenAI API specifies; off by default."""

    include_usage: StrictBool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None
    response_format: dict[str, JsonValue] | None = None
    tools: JsonValue = None
    tool_choice: JsonValue = None
    functions: JsonValue = None
    function_call: JsonValue = None
    guided_json: JsonValue = None
    guided_regex: JsonValue = None
    guided_choice: JsonValue = None
    guided_grammar: JsonValue = None
    regex: JsonValue = None
    json_schema: JsonValue = None
    ebnf: JsonValue = None
    structural_tag: JsonValue = None
    # extensions (vLLM / SGLang / transformers serve)
    ignore_eos: StrictBool | None = False
    min_tokens: StrictInt | None = None
    skip_special_tokens: StrictBool = True
    request_id: StrictStr | None = None
    rid: StrictStr | None = None
    generation_config: StrictStr | dict[str, JsonValue] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of strings / of
    token-id lists (checked by the server against the vocabulary)."""

    prompt: JsonValue = Field(...)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None


class ChatMessage(_Request):
    """One message; ``content`` a string or a list of ``{"type": "text", "text": ...}`` parts. Only an
    ``assistant`` message may leave ``content`` out or null (the OpenAI API requires it of the others)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, JsonValue]] | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content' (a string or a list of text parts)")
        return self

    def text(self) -> str:
        """The message's text (text parts joined; other part types are refused by the server)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(str(p.get("text", "")) for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template
    (``add_generation_prompt`` true unless the request says otherwise)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False


# --------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """OpenAI's legacy ``logprobs`` object plus ``top_logprob_ids`` (``[[id, logprob], ...]`` per token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    top_logprob_ids: list[list[tuple[int, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class VSkipperInfo(BaseModel):
    """The request as the engine saw it: engine request id, arm, and for switch arms its modes
    (``prefill_routed``, ``decode_routed_from``: absolute index of the first routed decode row, None
    when decode stayed dense; ``promoted``)."""

    model_config = ConfigDict(extra="allow")
    request_id: str
    arm: str
    prefill_routed: bool | None = None
    decode_routed_from: int | None = None
    promoted: bool | None = None


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogProbs | None = None
    token_ids: list[int] = Field(default_factory=list)
    vskipper: VSkipperInfo | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] = Field(default_factory=list)
    vskipper: VSkipperInfo | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] = Field(default_factory=list)
    vskipper: VSkipperInfo | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``; ``code`` is the HTTP status."""

    error: ErrorInfo

    @classmethod
    def of(cls, status: int, message: str, param: str | None = None, kind: str | None = None) -> "ErrorResponse":
        kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")
        return cls(error=ErrorInfo(message=message, type=kind, param=param, code=int(status)))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vskipper"
    max_model_len: int
    arm: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(obj: BaseModel, **kw: Any) -> str:
    """Compact JSON of a response model (``exclude`` etc. passed through)."""
    return obj.model_dump_json(**kw)
