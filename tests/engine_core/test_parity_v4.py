"""DeepSeek-V4 against the reference in transformers (>= 5.8; the test extra pins 5.24), on the same weights.

The tiny config (test_deepseek_v4_config.V4_TEST_CONFIG) has every layer type: window-only, CSA (with the lightning
indexer keeping fewer entries than are visible), HCA, and hash-routed MoE layers. Windows and compress ratios are
small, so prompts of 5 to 41 tokens and 8 decode steps cross the sliding window and close compressed windows in
prefill and in decode. Checks as for V3 (test_parity.check_against_reference): prefill logits of a mixed-length
batch, greedy tokens, per-step decode logprobs. The decode reference is transformers' own cached generation (its
per-step logits), not a teacher-forced forward: the indexer's top-k may break exact score ties differently in a row
whose length is the number of entries, so the reference's last-position logits can change with the input's length.
Then chunked prefill with split points inside and across compression windows, and preemption, change no token.
The generate half runs on prefix-cache hits of the prompts prefill_logits computed (test_prefix_cache_v4 has more).
"""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, SamplingParams
from tests.engine_core.test_deepseek_v4_config import V4_TEST_CONFIG
from tests.engine_core.test_parity import ATOL, prefill_logits, random_prompts, reference_logits

NUM_NEW = 8  # from 41 tokens, 8 more close two CSA windows and one HCA window in decode
PROMPT_LENGTHS = (5, 23, 41)  # within the first window, past it, past an HCA window with more CSA entries than top-k

transformers_v4 = pytest.importorskip(
    "transformers.models.deepseek_v4", reason="DeepSeek-V4's reference needs transformers >= 5.8 (the extra pins 5.24)"
)


def check_against_reference(llm: LLM, model, prompts: list[list[int]]) -> None:
    ours = prefill_logits(llm, prompts)
    for row, prompt in zip(ours, prompts, strict=True):
        torch.testing.assert_close(row, reference_logits(model, prompt)[-1], atol=ATOL, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NUM_NEW,
                min_new_tokens=NUM_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert out.token_ids == reference.sequences[0, len(prompt) :].tolist()
        for entry, logits in zip(out.logprobs, reference.logits, strict=True):
            row = logits[0].float().log_softmax(-1)
            top_ids, top_values = zip(*entry.top, strict=True)
            torch.testing.assert_close(torch.tensor(top_values), row[list(top_ids)], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def v4_reference(tmp_path_factory: pytest.TempPathFactory):
    """(directory, transformers model): random weights, with the tensors transformers initialises to zero (sinks,
    position biases, hyper-connection biases, correction bias, the hash table) drawn at random too."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**V4_TEST_CONFIG)).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                tensor.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(0.0, 0.2)
            elif name.endswith("tid2eid"):  # two distinct experts per token id
                buffer.copy_(torch.rand(buffer.shape[0], 8).argsort(dim=-1)[:, : buffer.shape[1]])
    path = tmp_path_factory.mktemp("deepseek-v4-random")
    model.save_pretrained(path)
    return path, model


def test_deepseek_v4_matches_transformers(v4_reference):
    path, model = v4_reference
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    assert llm.engine.kv.pool.enable_caching  # generate hits the blocks prefill_logits cached (16 and 32 tokens)
    check_against_reference(llm, model, random_prompts(512, PROMPT_LENGTHS))
    assert llm.engine.stats().num_prefix_hit_tokens == 16 + 32
    runner = llm.engine.runner
    assert len(runner.sequence_states) == 3  # the last step's states: dropped when the next step starts
    runner.drop_finished_states()
    assert runner.sequence_states == {}


def test_chunked_prefill_and_preemption_change_no_token(v4_reference):
    """Chunks of 3 tokens split CSA windows (4), HCA windows (8) and the sliding window (8) at every offset; with
    5 blocks of 16 tokens both requests start (2 blocks each) but cannot both grow past 32 tokens: one recomputes."""
    path, _model = v4_reference
    prompts = random_prompts(512, (30, 31))
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    whole = [o.token_ids for o in LLM(str(path), device="cpu", num_kv_blocks=64).generate(prompts, params)]
    chunked = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=3).generate(prompts, params)
    assert [o.token_ids for o in chunked] == whole
    tight = LLM(str(path), device="cpu", num_kv_blocks=5)
    assert [o.token_ids for o in tight.generate(prompts, params)] == whole
    assert tight.engine.stats().num_preemptions >= 1
