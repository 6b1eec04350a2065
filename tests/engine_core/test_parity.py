"""Our models against the reference implementations in `transformers`, on the same weights.

Logits are compared after prefill (whole batch of mixed-length prompts, several longer than a block) and at
every decode step (through logprobs, against the reference's teacher-forced log-softmax); greedy tokens
must be identical. Both paths of MLA are covered: expanded attention in prefill, absorbed in decode.
"""

from __future__ import annotations

import pytest
import torch

import devices.cpu
from devices.cpu_kernels import paged_chunk_kernel
from engine_core import LLM, SamplingParams

ATOL = 2e-4  # fp32 rounding differs between fused/paged and reference kernels; real bugs are orders larger
NUM_NEW = 12


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Last-position logits of every prompt, computed as one batch by the engine's own step machinery."""
    engine = llm.engine
    assert engine.kv.pool.reset_prefix_cache()  # a shared engine may hold these prefixes from other tests
    for i, prompt in enumerate(prompts):
        engine.add_request(f"logits-{i}", prompt, SamplingParams(max_tokens=1))
    output = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in output.scheduled] == [len(p) for p in prompts]
    logits = engine.runner.execute(output)
    engine.scheduler.update(output, {s.request.request_id: 0 for s in output.scheduled})
    return logits


def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()  # (L, V)


def check_against_reference(llm: LLM, model, prompts: list[list[int]]) -> None:
    ours = prefill_logits(llm, prompts)
    for row, prompt in zip(ours, prompts, strict=True):
        torch.testing.assert_close(row, reference_logits(model, prompt)[-1], atol=ATOL, rtol=0)
    check_generate_against_reference(llm, model, prompts)


def check_generate_against_reference(llm: LLM, model, prompts: list[list[int]]) -> None:
    """Greedy tokens equal to the reference's, and every step's logprobs within ATOL of its teacher-forced ones."""
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False, min_new_tokens=NUM_NEW
            )[0, len(prompt) :].tolist()
        assert out.token_ids == expected
        reference = reference_logits(model, prompt + out.token_ids).log_softmax(-1)  # (L + n, V)
        for step, entry in enumerate(out.logprobs):
            row = reference[len(prompt) - 1 + step]
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=ATOL)
            top_ids, top_values = zip(*entry.top, strict=True)
            torch.testing.assert_close(torch.tensor(top_values), row[list(top_ids)], atol=ATOL, rtol=0)


PROMPT_LENGTHS = (5, 16, 23, 41)  # shorter than, exactly, and longer than one 16-token block


def random_prompts(vocab: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def test_deepseek_v3_matches_transformers(deepseek_reference):
    path, model = deepseek_reference
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    assert llm.engine.runner.kv_caches.shape == (3, 64, 16, 32 + 8)  # the latent cache: R + P per token
    check_against_reference(llm, model, random_prompts(512))


def test_llama_gqa_matches_transformers(llama_reference):
    path, model = llama_reference
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    check_against_reference(llm, model, random_prompts(500))


def test_llama_chunks_attended_by_gemm_match_transformers(llama_reference, monkeypatch):
    # every chunk of 8 tokens over any context takes the cpu module's grouped GEMMs, not only late chunks of long
    # prompts (which this model's 1,024 positions cannot reach)
    monkeypatch.setattr(devices.cpu, "CHUNK_GEMM_MIN_CONTEXT", 1)
    num_calls, chunk_attention = [0], devices.cpu.chunk_attention

    def counted(*args):
        num_calls[0] += 1
        return chunk_attention(*args)

    monkeypatch.setattr(devices.cpu, "chunk_attention", counted)
    path, model = llama_reference
    # the C++ kernels off: with them the chunk kernel takes these chunks (the test below)
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=8, cpu_decode_kernel=False)
    check_generate_against_reference(llm, model, random_prompts(500))
    assert num_calls[0] >= 3 * 12  # 3 layers; at least the 1, 2, 3 and 6 chunks of the 5, 16, 23 and 41 tokens


def test_llama_chunks_attended_by_the_chunk_kernel_match_transformers(llama_reference):
    """Chunks of 8 tokens over their cached context, read in place by the C++ chunk kernel."""
    path, model = llama_reference
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=8)
    ops = llm.engine.ops
    kernel = paged_chunk_kernel()  # taken here even where the engine leaves it off (AVX2: chunk_kernel_pays)
    assert kernel is not None, "the kernels did not build (g++ and ninja are part of the test environment)"
    num_calls = [0]

    def counted(*args):
        num_calls[0] += 1
        return kernel(*args)

    ops.chunk_kernel = counted
    check_generate_against_reference(llm, model, random_prompts(500))
    assert num_calls[0] >= 3 * 12  # as above


def test_chunked_prefill_and_prefix_reuse_change_nothing(deepseek_reference):
    path, _model = deepseek_reference
    prompts = random_prompts(512, (37, 45))
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    whole = LLM(str(path), device="cpu", num_kv_blocks=64).generate(prompts, params)
    chunked_llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=8)
    chunked = chunked_llm.generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    again = chunked_llm.generate(prompts, params)  # now served from the prefix cache
    assert [o.num_cached_tokens for o in again] == [32, 32]
    assert [o.token_ids for o in again] == [o.token_ids for o in whole]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    ).eval()


def test_smollm2_gguf_matches_transformers(smollm2_llm, smollm2_reference):
    tokenizer = smollm2_llm.tokenizer
    texts = [
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow, please."}]),
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert max(len(p) for p in prompts) > 32  # several blocks
    check_against_reference(smollm2_llm, smollm2_reference, prompts)
