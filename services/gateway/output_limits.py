"""The server's bounds on output length, per model (KVMESH_DEFAULT_MAX_TOKENS, KVMESH_MAX_OUTPUT_TOKENS), applied
to every API in one place (GatewayCore.generation) once the prompt is tokenized:

- a request that sets no output length gets the default (legacy completions: its API's own, 16), cut to the
  maximum and to what the context leaves (never an error: the client did not ask for it);
- a request that asks for more than the maximum is a 400 naming its field, as OpenAI answers a `max_tokens` over
  a model's output limit (clamping it would hand back less than asked without saying so).

Each setting is `N` (every model), `model=N,...`, or both (`N,model=M`: M for that model, N for the rest); 0 is
no bound: the default is then the rest of the context, the maximum the context itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mesh.pb import common_pb2
from services.gateway.errors import invalid

EVERY_MODEL = ""  # the key of a bare `N`


def parse_per_model(entries: tuple[str, ...], name: str) -> dict[str, int]:
    """`("4096", "deepseek-tiny=1024")` -> {"": 4096, "deepseek-tiny": 1024}; raises ValueError naming `name`."""
    values: dict[str, int] = {}
    for entry in entries:
        model, _, raw = entry.rpartition("=")
        model = model.strip()
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{name}: {entry!r} is neither N nor model=N") from None
        if value < 0:
            raise ValueError(f"{name}: {entry!r} is negative")
        if model in values:
            raise ValueError(f"{name}: {model or 'the value for every model'} is given twice")
        values[model] = value
    return values


@dataclass(frozen=True)
class OutputLimits:
    defaults: Mapping[str, int] = field(default_factory=dict)  # model (or EVERY_MODEL) -> tokens; 0: none
    maximums: Mapping[str, int] = field(default_factory=dict)

    def default_for(self, model: str) -> int:
        return self.defaults.get(model, self.defaults.get(EVERY_MODEL, 0))

    def maximum_for(self, model: str) -> int:
        return self.maximums.get(model, self.maximums.get(EVERY_MODEL, 0))

    def apply(
        self, model: str, room: int, sampling: common_pb2.SamplingParams, param: str, api_default: int | None = None
    ) -> None:
        """Check or fill in `sampling.max_tokens`; `room`: the tokens the context leaves after the prompt,
        `param`: the client's name for the field, for the error; `api_default`: the API's own default, which
        stands in for the server's (legacy completions: 16)."""
        maximum = self.maximum_for(model)
        if sampling.HasField("max_tokens"):
            if maximum and sampling.max_tokens > maximum:
                raise invalid(
                    param,
                    f"{param} is too large: {sampling.max_tokens}; this server allows at most {maximum} output "
                    f"tokens for {model!r}",
                )
            return
        default = api_default if api_default is not None else self.default_for(model)
        bounds = [b for b in (default, maximum) if b > 0]
        if bounds and room > 0:  # (no room: check_lengths refuses the prompt)
            sampling.max_tokens = max(min(*bounds, room), min(sampling.min_tokens, room))
