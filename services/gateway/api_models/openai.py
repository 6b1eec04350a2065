"""OpenAI's Chat Completions and (legacy) Completions request bodies, and the parts the Responses API shares
with them (text and image parts, tool_choice, response_format's JSON Schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Tag, TypeAdapter
from pydantic.json_schema import SkipJsonSchema

from services.gateway.api_models.base import (
    MAX_MESSAGES,
    Bool,
    Int,
    JsonObject,
    NonEmptyStr,
    Refused,
    RequestModel,
    Str,
    by_shape,
    reported_whole,
    tag_by_field,
    tag_by_type,
)
from services.gateway.api_models.sampling import MaxTokens, SamplingFields
from services.gateway.chat import MAX_N
from services.gateway.tool_calls import TOOL_NAME

MAX_STOP_STRINGS = 4
# A stop string's characters: the detokenizer holds back output that could begin one and checks each held tail
# against it on every token, so a 7.9 MiB stop string was quadratic work per token on the event loop.
MAX_STOP_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5
TEXT_PART_TYPES = ("text", "input_text", "output_text")
IMAGE_PART_TYPES = ("image_url", "input_image")


# ---- content -------------------------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text", "input_text", "output_text"]
    text: Str


class ImageUrl(RequestModel):
    url: NonEmptyStr
    detail: Literal["auto", "low", "high"] | None = None


IMAGE_SHAPE = 'must be {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}'


class ImageUrlPart(RequestModel):
    """Chat Completions' image_url part ({"url": ...}, or the URL alone), or the Responses API's input_image."""

    type: Literal["image_url", "input_image"]
    image_url: Annotated[
        Annotated[NonEmptyStr, Tag("Url")] | Annotated[ImageUrl, Tag("ImageUrl")],
        by_shape(lambda v: "Url" if isinstance(v, str) else "ImageUrl", "must be {'url': ...}"),
    ]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


Part = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[ImageUrlPart, reported_whole(IMAGE_SHAPE), Tag("ImagePart")],
    by_shape(
        lambda v: tag_by_type(
            v, {**dict.fromkeys(TEXT_PART_TYPES, "TextPart"), **dict.fromkeys(IMAGE_PART_TYPES, "ImagePart")}
        ),
        'must be a text or image_url part: {"type": "text", "text": ...}',
    ),
]
Content = Annotated[
    Annotated[Str, Tag("Text")] | Annotated[list[Part], Tag("Parts")],
    by_shape(
        lambda v: "Text" if isinstance(v, str) else "Parts" if isinstance(v, list) else None,
        "must be a string or a list of text parts",
    ),
]


class FunctionCall(RequestModel):
    name: Str
    arguments: Str = "{}"


class ToolCall(RequestModel):
    """A past tool call, in an assistant message."""

    id: Str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


TEXT_PART_SHAPE = 'must be a text part: {"type": "text", "text": ...} (images are taken in user messages only)'
TextContent = Annotated[
    Annotated[Str, Tag("Text")] | Annotated[list[Annotated[TextPart, reported_whole(TEXT_PART_SHAPE)]], Tag("Parts")],
    by_shape(
        lambda v: "Text" if isinstance(v, str) else "Parts" if isinstance(v, list) else None,
        "must be a string or a list of text parts",
    ),
]


class SystemMessage(RequestModel):
    role: Literal["system", "developer"]
    content: TextContent


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Content  # images in user messages only


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: TextContent | None = None  # none: only tool calls
    tool_calls: tuple[ToolCall, ...] = ()


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: NonEmptyStr  # the call it answers


class UnknownRole(RequestModel):
    """Not in the document: a message whose role is none of ROLES, refused at its `role`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]


def _role_tag(value: Any) -> str | None:
    tags = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
    return tag_by_field(value, "role", tags, unknown="UnknownRole")


ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("System")]
    | Annotated[UserMessage, Tag("User")]
    | Annotated[AssistantMessage, Tag("Assistant")]
    | Annotated[ToolMessage, Tag("Tool")]
    | SkipJsonSchema[Annotated[UnknownRole, Tag("UnknownRole")]],
    by_shape(_role_tag, "must be an object"),
]
CHAT_MESSAGE: TypeAdapter[SystemMessage | UserMessage | AssistantMessage | ToolMessage | UnknownRole] = TypeAdapter(
    ChatMessage
)


# ---- tools and formats -----------------------------------------------------------------------------------

ToolName = Annotated[Str, Field(pattern=f"^{TOOL_NAME.pattern}$")]
JsonSchema = Annotated[
    Annotated[JsonObject, Field(description="a JSON Schema (the subset structured output enforces)"), Tag("Schema")]
    | Annotated[Literal[True], Tag("Boolean")],  # false admits nothing: no grammar can follow it
    by_shape(
        lambda v: "Schema" if isinstance(v, dict) else "Boolean" if isinstance(v, bool) else None,
        "must be a JSON Schema object",
    ),
]


class FunctionDefinition(RequestModel):
    name: ToolName
    description: Str | None = None
    parameters: JsonObject | None = None  # a JSON Schema; none: no arguments
    strict: Bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: NonEmptyStr


class NamedToolChoice(RequestModel):
    """{"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: NamedFunction

    @property
    def function_name(self) -> str:
        return self.function.name


class FlatNamedToolChoice(RequestModel):
    """The Responses API's {"type": "function", "name": ...}."""

    type: Literal["function"]
    name: NonEmptyStr

    @property
    def function_name(self) -> str:
        return self.name


TOOL_CHOICE_SHAPE = 'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'


def _tool_choice_tag(value: Any) -> str | None:
    if value in ("none", "auto", "required"):
        return "Mode"
    if isinstance(value, dict):
        return "Named" if "function" in value else "FlatNamed"
    return None


ToolChoiceField = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("Mode")]
    | Annotated[NamedToolChoice, reported_whole(TOOL_CHOICE_SHAPE), Tag("Named")]
    | Annotated[FlatNamedToolChoice, reported_whole(TOOL_CHOICE_SHAPE), Tag("FlatNamed")],
    by_shape(_tool_choice_tag, TOOL_CHOICE_SHAPE),
]


class JsonSchemaSpec(RequestModel):
    name: Str
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    description: Str | None = None
    strict: Bool | None = None


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: Annotated[JsonSchemaSpec, reported_whole("must be an object with a 'name' and a 'schema'")]


# an output format's three kinds, by `type`: here and in the Responses API's text.format (whose json_schema is flat)
FORMAT_BY_TYPE = by_shape(
    lambda v: tag_by_type(v, {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}),
    "must be {\"type\": 'text', 'json_object' or 'json_schema'}",
)
ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("Text")]
    | Annotated[JsonObjectFormat, Tag("JsonObject")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchema")],
    FORMAT_BY_TYPE,
]


# ---- shared fields -----------------------------------------------------------------------------------------


def _stop_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "One"
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return "Many"
    return None


StopString = Annotated[str, Field(strict=True, max_length=MAX_STOP_CHARS)]
Stop = Annotated[
    Annotated[StopString, Tag("One")] | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), Tag("Many")],
    by_shape(_stop_kind, "must be a string or an array of strings"),
]


class StreamOptions(RequestModel):
    include_usage: Bool = False


def _only_with(field: str, needs: str) -> dict[str, Any]:
    """A rule the server checks across fields, in the document: `field` set (not null) needs `needs`: true."""
    return {
        "anyOf": [
            {"required": [needs], "properties": {needs: {"type": "boolean", "enum": [True]}}},
            {"properties": {field: {"enum": [None], "nullable": True}}},  # absent or null
        ]
    }


STREAM_OPTIONS_RULE = _only_with("stream_options", "stream")
TOP_LOGPROBS_RULE = _only_with("top_logprobs", "logprobs")


class OpenAIRequest(SamplingFields):
    """What Chat Completions and Completions share."""

    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_RULE]})

    model: NonEmptyStr
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stop: Stop | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    cache_salt: Str = Field("", description="enters every KV block's key: differently salted prompts share no KV")
    logit_bias: Refused = None


class ChatCompletionRequest(OpenAIRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_RULE, TOP_LOGPROBS_RULE]})

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    functions: Refused = None
    function_call: Refused = None
    audio: Refused = None
    modalities: Refused = None
    prediction: Refused = None
    tools: tuple[ChatTool, ...] = ()
    tool_choice: ToolChoiceField | None = None  # none: auto with tools, else none
    parallel_tool_calls: Bool = True
    max_completion_tokens: MaxTokens | None = None  # wins over max_tokens
    max_tokens: MaxTokens | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # needs logprobs: true
    response_format: ResponseFormat | None = None


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "Text"
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return "OneText" if isinstance(value[0], str) else "OneTokenIds"  # a batch of one
    return "TokenIds" if isinstance(value, list) else None


TokenIds = Annotated[list[Int], Field(min_length=1)]
PROMPT_SHAPE = "must be a string or an array of token ids (one prompt per request)"
Prompt = Annotated[
    Annotated[Str, Tag("Text")]
    | Annotated[TokenIds, reported_whole(PROMPT_SHAPE), Tag("TokenIds")]
    | Annotated[list[Str], Field(min_length=1, max_length=1), Tag("OneText")]
    | Annotated[
        Annotated[list[TokenIds], Field(min_length=1, max_length=1), reported_whole(PROMPT_SHAPE)], Tag("OneTokenIds")
    ],
    by_shape(_prompt_kind, PROMPT_SHAPE),
]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt
    suffix: Refused = None
    best_of: Annotated[Int, Field(ge=1, le=1, description="only 1")] = 1
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LEGACY_LOGPROBS)] | None = None
    echo: Bool = False

    @property
    def prompt_value(self) -> str | list[int]:
        """The one prompt (a batch of one unwrapped)."""
        prompt = self.prompt
        return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt
