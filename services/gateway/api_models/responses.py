"""OpenAI's Responses API request body (/v1/responses)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, Tag
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
from services.gateway.api_models.openai import (
    FORMAT_BY_TYPE,
    Content,
    JsonObjectFormat,
    JsonSchema,
    TextContent,
    TextFormat,
    ToolChoiceField,
    ToolName,
)
from services.gateway.api_models.sampling import MaxTokens, SeededSampling

RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9]{1,64}")


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user"]
    content: Content  # images in user messages only


class InstructionMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer"]
    content: TextContent


class AssistantInput(RequestModel):
    """A past turn of the model's."""

    type: Literal["message"] = "message"
    role: Literal["assistant"]
    content: TextContent | None = None  # none: nothing said


class UnknownInputRole(RequestModel):
    """Not in the document: a message whose role is none of the above, refused at its `role`."""

    role: Literal["user", "system", "developer", "assistant"]


def _item_tag(value: Any) -> str | None:
    items = {"message": "Message", "function_call": "Call", "function_call_output": "Output"}
    kind = tag_by_type(value, items, "message")
    if kind != "Message":
        return kind
    roles = {"user": "User", "system": "Instruction", "developer": "Instruction", "assistant": "Assistant"}
    return tag_by_field(value, "role", roles, unknown="UnknownRole")


class FunctionCallItem(RequestModel):
    """A past function call (the model's), to send its output after it."""

    type: Literal["function_call"]
    call_id: Str
    name: Str
    arguments: Str = "{}"


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: Str
    output: Str


InputItem = Annotated[
    Annotated[InputMessage, Tag("User")]
    | Annotated[InstructionMessage, Tag("Instruction")]
    | Annotated[AssistantInput, Tag("Assistant")]
    | SkipJsonSchema[Annotated[UnknownInputRole, Tag("UnknownRole")]]
    | Annotated[FunctionCallItem, reported_whole("needs string 'call_id', 'name' and 'arguments'"), Tag("Call")]
    | Annotated[FunctionCallOutputItem, reported_whole("needs string 'call_id' and 'output'"), Tag("Output")],
    by_shape(_item_tag, "must be a message, function_call or function_call_output item"),
]
Input = Annotated[
    Annotated[Str, Tag("Text")]
    | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES), Tag("Items")],
    by_shape(
        lambda v: "Text" if isinstance(v, str) else "Items" if isinstance(v, list) else None,
        "must be a string or a non-empty array of input items",
    ),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: ToolName
    description: Str | None = None
    parameters: JsonObject | None = None  # a JSON Schema; none: no arguments
    strict: Bool | None = None


class JsonSchemaTextFormat(RequestModel):
    """Flat here; nested under `json_schema` in Chat Completions."""

    type: Literal["json_schema"]
    name: Str
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    description: Str | None = None
    strict: Bool | None = None


TextFormatField = Annotated[
    Annotated[TextFormat, Tag("Text")]
    | Annotated[JsonObjectFormat, Tag("JsonObject")]
    | Annotated[JsonSchemaTextFormat, Tag("JsonSchema")],
    FORMAT_BY_TYPE,
]


class TextConfig(RequestModel):
    format: TextFormatField | None = None  # none: text


class ResponsesRequest(SeededSampling):
    model: NonEmptyStr
    input: Input
    instructions: Str | None = None  # a system message before the conversation
    previous_response_id: Annotated[Str, Field(pattern=f"^{RESPONSE_ID.pattern}$")] | None = None
    store: Bool = True
    stream: Bool = False
    max_output_tokens: MaxTokens | None = None
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoiceField | None = None  # none: auto with tools, else none
    parallel_tool_calls: Bool = True
    text: TextConfig = TextConfig()
    metadata: JsonObject = Field(default_factory=dict)
    user: Str | None = None
    cache_salt: Str = ""
