"""The offline API, in the shape vLLM users know:

from engine_core import LLM, SamplingParams
llm = LLM(model="smollm2-135m")
for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=16)):
    print(out.text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_core.config import EngineConfig
from engine_core.engine import LLMEngine
from engine_core.request import TokenLogprobs
from engine_core.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (strings or token-id lists), batched; outputs in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        outputs: dict[str, GenerationOutput] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = f"gen-{next(self._ids)}"
            request = self.engine.add_request(request_id, prompt, params)
            outputs[request_id] = GenerationOutput(request_id, list(request.prompt_token_ids))
        while self.engine.has_unfinished_requests():
            for step_output in self.engine.step():
                out = outputs[step_output.request_id]
                out.token_ids.extend(step_output.new_token_ids)
                out.logprobs.extend(step_output.new_logprobs)
                out.num_cached_tokens = step_output.num_cached_tokens
                if step_output.finished:
                    out.finish_reason = step_output.finish_reason
        if self.engine.tokenizer is not None:
            for out in outputs.values():
                out.text = self.engine.tokenizer.decode(out.token_ids)
        return list(outputs.values())

    def chat(
        self, messages: Sequence[dict[str, Any]], sampling_params: SamplingParams | None = None
    ) -> GenerationOutput:
        """One chat turn rendered with the model's chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return self.generate([prompt], sampling_params)[0]
