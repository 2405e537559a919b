"""Request and response models of the OpenAI- and Anthropic-compatible routes.

Requests are validated strictly (a string is not a number, a number is not a boolean); unknown
fields are ignored so that clients sending newer or vendor-specific fields keep working. Range
checks that need the loaded model (vocabulary, context) happen later, in ``params``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- OpenAI requests ---------------------------------------------------------------------------


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class FunctionCall(_Strict):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    function_call: Optional[Any] = None  # legacy: refused with a 400 that says to send tool_calls


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[Dict[str, Any]] = None


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, lt=1.0)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    stop: Union[str, List[str], None] = None
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    functions: Optional[Any] = None  # legacy spellings of tools / tool_choice: refused with a 400
    function_call: Optional[Any] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


# ---- Anthropic requests ------------------------------------------------------------------------


class AnthropicBlock(_Strict):
    """One content block; which fields matter depends on ``type``."""

    type: str
    text: Optional[str] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, List[Dict[str, Any]], None] = None
    is_error: Optional[bool] = None


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, List[AnthropicBlock]]


class AnthropicTool(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None
    type: Optional[str] = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class AnthropicThinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class MessagesRequest(_Strict):
    model: str
    messages: List[AnthropicMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    system: Union[str, List[AnthropicBlock], None] = None
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    stream: bool = False
    tools: Optional[List[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinking] = None
    metadata: Optional[Dict[str, Any]] = None
    output_config: Optional[Dict[str, Any]] = None  # {"format": {"type": "json_schema", "schema": ...}}
    output_format: Optional[Dict[str, Any]] = None  # the structured-outputs beta's spelling of the same
    logit_bias: Optional[Dict[str, float]] = None  # a dflash2-mlx extension, as on the OpenAI routes


# ---- responses ---------------------------------------------------------------------------------


class Speculative(_Out):
    acceptance_length: float
    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    # per draft source ("dflash": the drafter's blocks, "copy": copies of the context): cycles,
    # drafted and accepted tokens
    by_source: Optional[dict] = None
    controller: Optional[dict] = None  # the block-size policy's statistics (controller.BlockPolicy.summary)


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[Dict[str, int]] = None


class ResponseFunction(_Out):
    name: str
    arguments: str


class ResponseToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ResponseToolCall]] = None


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage
    speculative: Speculative


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[str] = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Usage
    speculative: Speculative


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash2-mlx"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: List[ModelCard]
