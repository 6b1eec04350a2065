"""Anthropic's Messages request body (/v1/messages)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag
from pydantic.json_schema import SkipJsonSchema

from services.gateway.api_models.base import (
    MAX_MESSAGES,
    Bool,
    JsonObject,
    NonEmptyStr,
    RequestModel,
    Str,
    by_shape,
    reported_whole,
    tag_by_field,
    tag_by_type,
)
from services.gateway.api_models.openai import Stop, ToolName
from services.gateway.api_models.sampling import CoreSampling, MaxTokens


class TextBlock(RequestModel):
    type: Literal["text"]
    text: Str


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Str
    data: Str


class UrlSource(RequestModel):
    type: Literal["url"]
    url: Str


SOURCE_SHAPE = 'must be {"type": "base64", "media_type": "image/png", "data": ...} or {"type": "url", "url": ...}'


class ImageBlock(RequestModel):
    """User messages only."""

    type: Literal["image"]
    source: Annotated[
        Annotated[Base64Source, reported_whole(SOURCE_SHAPE), Tag("Base64")]
        | Annotated[UrlSource, reported_whole(SOURCE_SHAPE), Tag("Url")],
        by_shape(lambda v: tag_by_type(v, {"base64": "Base64", "url": "Url"}), SOURCE_SHAPE),
    ]

    @property
    def url(self) -> str:
        if isinstance(self.source, Base64Source):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


class ToolUseBlock(RequestModel):
    """A past tool call: assistant messages only."""

    type: Literal["tool_use"]
    id: Str = ""
    name: Str
    input: JsonObject = Field(default_factory=dict)


def _text_or_blocks(value: Any) -> str | None:
    return "Text" if isinstance(value, str) else "Blocks" if isinstance(value, list) else None


TextBlocks = Annotated[
    Annotated[Str, Tag("Text")] | Annotated[list[TextBlock], Tag("Blocks")],
    by_shape(_text_or_blocks, "must be a string or an array of text blocks"),
]


class ToolResultBlock(RequestModel):
    """A tool's output: user messages only."""

    type: Literal["tool_result"]
    tool_use_id: Str
    content: TextBlocks = ""
    is_error: Bool = False


BLOCK_SHAPE = "must be a text block, an image or tool_result block (user) or a tool_use block (assistant)"
BLOCK_TAGS = {"text": "Text", "image": "Image", "tool_use": "ToolUse", "tool_result": "ToolResult"}


def _block_of(*allowed: str) -> Discriminator:
    """The blocks a role may send; any other is refused with BLOCK_SHAPE."""
    return by_shape(lambda v: kind if (kind := tag_by_type(v, BLOCK_TAGS)) in allowed else None, BLOCK_SHAPE)


UserBlock = Annotated[
    Annotated[TextBlock, Tag("Text")]
    | Annotated[ImageBlock, Tag("Image")]
    | Annotated[ToolResultBlock, Tag("ToolResult")],
    _block_of("Text", "Image", "ToolResult"),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("Text")] | Annotated[ToolUseBlock, Tag("ToolUse")], _block_of("Text", "ToolUse")
]
CONTENT_SHAPE = "must be a string or an array of content blocks"


class UserTurn(RequestModel):
    role: Literal["user"]
    content: Annotated[
        Annotated[Str, Tag("Text")] | Annotated[list[UserBlock], Tag("Blocks")],
        by_shape(_text_or_blocks, CONTENT_SHAPE),
    ]


class AssistantTurn(RequestModel):
    role: Literal["assistant"]
    content: Annotated[
        Annotated[Str, Tag("Text")] | Annotated[list[AssistantBlock], Tag("Blocks")],
        by_shape(_text_or_blocks, CONTENT_SHAPE),
    ]


class UnknownTurn(RequestModel):
    """Not in the document: a message whose role is neither, refused at its `role`."""

    role: Literal["user", "assistant"]


AnthropicMessage = Annotated[
    Annotated[UserTurn, Tag("User")]
    | Annotated[AssistantTurn, Tag("Assistant")]
    | SkipJsonSchema[Annotated[UnknownTurn, Tag("Unknown")]],
    by_shape(
        lambda v: tag_by_field(v, "role", {"user": "User", "assistant": "Assistant"}, unknown="Unknown"),
        "must be an object",
    ),
]


class AnthropicTool(RequestModel):
    name: ToolName
    description: Str | None = None
    input_schema: JsonObject | None = None  # a JSON Schema; none: no input


TOOL_CHOICE_SHAPE = 'must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'


class AnthropicModeChoice(RequestModel):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: Bool = False


class AnthropicNamedChoice(RequestModel):
    type: Literal["tool"]
    name: NonEmptyStr
    disable_parallel_tool_use: Bool = False


AnthropicToolChoice = Annotated[
    Annotated[AnthropicModeChoice, reported_whole(TOOL_CHOICE_SHAPE), Tag("Any")]
    | Annotated[AnthropicNamedChoice, reported_whole(TOOL_CHOICE_SHAPE), Tag("Named")],
    by_shape(
        lambda v: tag_by_type(v, {"auto": "Any", "any": "Any", "none": "Any", "tool": "Named"}), TOOL_CHOICE_SHAPE
    ),
]


class MessagesRequest(CoreSampling):
    model: NonEmptyStr
    max_tokens: MaxTokens
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: TextBlocks | None = None
    stop_sequences: Stop | None = None
    stream: Bool = False
    tools: tuple[AnthropicTool, ...] = ()
    tool_choice: AnthropicToolChoice | None = None
