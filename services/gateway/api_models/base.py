"""What every request model shares: JSON's types taken strictly (an integer field refuses 1.0 and true), null
read as absent, unknown fields ignored; unions chosen by a function with one message when none fits; and the
one function that turns a pydantic ValidationError into the GatewayError naming the client's field."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import ErrorDetails, PydanticCustomError

from services.gateway.errors import GatewayError, invalid

INT32_MAX = 2**31 - 1  # the wire's widths (common.proto): a value past them cannot travel
INT64_MAX = 2**63 - 1
# Messages (or Responses input items) in one request. Every message costs at least one token of context, and
# validating each costs the event loop ~50 us: 20,000 of them held it for 1-2 s. The count is checked before any
# message is read.
MAX_MESSAGES = 2048

# JSON's types as the gateway reads them: a number is an int or float but never a bool, an integer never 1.0
Int = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Str = Annotated[str, Field(strict=True)]
Bool = Annotated[bool, Field(strict=True)]
NonEmptyStr = Annotated[str, Field(strict=True, min_length=1)]
JsonObject = dict[str, Any]


class RequestModel(BaseModel):
    """A request body or a part of one. Null is read as absent (the field's default), as OpenAI's servers do."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def by_shape(choose: Callable[[Any], str | None], message: str) -> Discriminator:
    """Picks a union's member, each Annotated with a Tag, by the value's shape (`choose` returns the tag).
    Tags are CamelCase, so they never read as field names in an error's location; a value no member fits is
    refused at the union itself with `message`."""
    return Discriminator(choose, custom_error_type="no_member", custom_error_message=message)


def tag_by_field(
    value: Any, field: str, tags: dict[str, str], default: str | None = None, unknown: str | None = None
) -> str | None:
    """For `by_shape`: the tag of an object by one of its fields (`default` when unset, `unknown` for a value
    not in `tags`); None, refusing the value, when it is no object."""
    if not isinstance(value, dict):
        return None
    kind = value.get(field)
    kind = default if kind is None else kind  # null is absent
    return tags[kind] if isinstance(kind, str) and kind in tags else unknown


def tag_by_type(value: Any, tags: dict[str, str], default: str | None = None) -> str | None:
    return tag_by_field(value, "type", tags, default)


def _refuse(value: Any) -> Any:
    if value not in (False, [], {}, ""):
        raise PydanticCustomError("unsupported", "is not supported by this server")
    return value


# A field the server cannot honour: any value but an empty one is refused by name, never silently dropped. Not
# in the document (a client has nothing to send there).
Refused = SkipJsonSchema[Annotated[Any, AfterValidator(_refuse)]]


def reported_whole(message: str) -> WrapValidator:
    """Errors inside this object are reported at the object itself, with `message` (its expected shape)."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("shape", message) from None

    return WrapValidator(validate)


# ---- ValidationError -> GatewayError ----------------------------------------------------------------------

_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}  # pydantic's own tags for union members
_NOUNS = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "an array",
}


def param_of(loc: tuple[int | str, ...], at: str = "") -> str | None:
    """pydantic's location as the client's field: ('messages', 1, 'content') -> messages[1].content. Union
    member tags (CamelCase or pydantic's type names) are not fields and are left out."""
    param = at
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
    return param or None


# a numeric bound's error type -> (its key in the error's ctx, how the message words it)
_BOUNDS = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "greater than"),
    "less_than_equal": ("le", "at most"),
}


def _message(error: ErrorDetails, param: str | None) -> str:
    name = param or "the request body"
    kind, ctx = error["type"], error.get("ctx") or {}
    got = error.get("input")
    if kind in _NOUNS:
        return f"'{name}' must be {_NOUNS[kind]}"
    if kind == "missing":
        return f"'{name}' is required"
    if kind in _BOUNDS:
        bound, relation = _BOUNDS[kind]
        return f"{name}: must be {relation} {ctx[bound]}, got {got}"
    if kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
        return f"'{name}' must not be empty"
    if kind == "too_long":
        return f"'{name}' takes at most {ctx['max_length']} items, got {ctx.get('actual_length')}"
    if kind == "string_pattern_mismatch":
        return f"'{name}' must match {ctx['pattern']}"
    if kind == "literal_error":
        return f"'{name}' must be {ctx['expected']}"
    return f"'{name}' {error['msg']}" if kind in ("no_member", "shape", "unsupported") else f"{name}: {error['msg']}"


def gateway_error(error: ValidationError, at: str = "") -> GatewayError:
    """The first error (fields are checked in the order the model declares them), as a 400 naming the field
    (under `at`, where the model is part of a larger request)."""
    first = error.errors(include_url=False)[0]
    param = param_of(first["loc"], at)
    return invalid(param, _message(first, param))


M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def validated(model: type[M], body: Any) -> M:
    """The request body as `model`, or a GatewayError naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise gateway_error(exc) from None


def validated_part(adapter: TypeAdapter[T], value: Any, at: str) -> T:
    """A part of a larger request (its location `at`, e.g. messages[2]) as `adapter` reads it."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise gateway_error(exc, at) from None
