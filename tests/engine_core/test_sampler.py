import math

import pytest
import torch

from engine_core.sampler import Sampler
from engine_core.sampling_candidates import Workspace
from engine_core.sampling_params import SamplingParams, SamplingParamsError

from .helpers import make_request

VOCAB = 50


def logits_row(seed=0):
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(params_list, rows=None, outputs=None, sampler=None):
    requests = [make_request(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params_list)]
    for request, tokens in zip(requests, outputs or [[]] * len(requests), strict=True):
        for t in tokens:
            request.append_output_token(t)
    logits = torch.stack(rows or [logits_row(i) for i in range(len(requests))])
    return (sampler or Sampler()).__call__(logits, requests)


def test_greedy_is_argmax():
    row = logits_row()
    assert sample([SamplingParams(temperature=0)], [row]).token_ids == [int(row.argmax())]


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = sample([params], [logits_row(7)]).token_ids[0]
    crowded = sample(
        [SamplingParams(temperature=1.0), params, SamplingParams(temperature=0.5, seed=9)],
        [logits_row(1), logits_row(7), logits_row(2)],
        sampler=Sampler(seed=99),
    ).token_ids[1]
    assert alone == crowded
    draws = {sample([SamplingParams(temperature=1.0, seed=s)], [logits_row(7)]).token_ids[0] for s in range(40)}
    assert len(draws) > 3  # different seeds do differ


def test_the_seeded_stream_depends_on_the_output_position():
    params = SamplingParams(temperature=2.0, seed=5)
    flat = torch.zeros(VOCAB)
    at = [sample([params], [flat], outputs=[[0] * n]).token_ids[0] for n in range(6)]
    assert len(set(at)) > 1
    assert at == [sample([params], [flat], outputs=[[0] * n]).token_ids[0] for n in range(6)]


def test_top_k_and_top_p_and_min_p_restrict_draws():
    row = torch.linspace(0, 10, VOCAB)  # token 49 most likely, then 48, ...
    top_k = {sample([SamplingParams(temperature=5.0, top_k=3, seed=s)], [row]).token_ids[0] for s in range(200)}
    assert top_k == {47, 48, 49}
    probs = row.softmax(-1)
    # top_p=0.5 keeps the smallest set of most likely tokens whose mass reaches 0.5
    needed = int((probs.sort(descending=True).values.cumsum(0) < 0.5).sum()) + 1
    top_p = {sample([SamplingParams(top_p=0.5, seed=s)], [row]).token_ids[0] for s in range(300)}
    assert top_p <= set(range(VOCAB - needed, VOCAB)) and len(top_p) > 1
    min_p = {sample([SamplingParams(min_p=0.5, seed=s)], [row]).token_ids[0] for s in range(300)}
    # min_p keeps tokens with at least half the best probability: logit within ln 2 of the max
    assert min_p == {t for t in range(VOCAB) if row[t] >= 10 - math.log(2)}


def test_sampling_follows_the_distribution():
    row = torch.log(torch.tensor([0.7, 0.2, 0.1] + [0.0] * (VOCAB - 3)))
    counts = torch.zeros(VOCAB)
    for s in range(2000):
        counts[sample([SamplingParams(seed=s)], [row]).token_ids[0]] += 1
    assert counts[3:].sum() == 0
    torch.testing.assert_close(counts[:3] / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_penalties_change_logits_exactly():
    row = torch.zeros(VOCAB)
    row[5], row[6], row[7] = 2.0, -2.0, 1.0
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    requests = [make_request("r", [7], params)]
    for t in (5, 5, 6):
        requests[0].append_output_token(t)
    from engine_core.sampler import _apply_penalties

    out = _apply_penalties(row[None].clone(), requests)[0]
    assert out[5].item() == 2.0 - 0.5 - 0.25 * 2
    assert out[6].item() == -2.0 - 0.5 - 0.25
    assert out[7].item() == 1.0  # a prompt token: presence/frequency only count outputs
    rep = [make_request("r", [7], SamplingParams(repetition_penalty=2.0))]
    rep[0].append_output_token(6)
    out = _apply_penalties(row[None].clone(), rep)[0]
    assert (out[5].item(), out[6].item(), out[7].item()) == (2.0, -4.0, 0.5)


def test_logprobs_come_from_the_raw_distribution_with_ranks():
    row = logits_row(3)
    result = sample([SamplingParams(temperature=0, logprobs=3, presence_penalty=1.0)], [row])
    entry = result.logprobs[0]
    reference = row.log_softmax(-1)
    assert entry.token_id == int(row.argmax()) and entry.rank == 1
    assert entry.logprob == pytest.approx(float(reference.max()))
    assert [t for t, _ in entry.top] == reference.topk(3).indices.tolist()
    assert sample([SamplingParams(temperature=0)], [row]).logprobs == [None]


def test_token_mask_hook_restricts_choices():
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[3, 4]] = True
    seen = []

    def mask(outputs):
        seen.append(list(outputs))
        return allowed

    row = logits_row(0)
    row[4] = row.max() + 1
    result = sample([SamplingParams(temperature=0, token_mask=mask)], [row], outputs=[[9]])
    assert result.token_ids == [4] and seen == [[9]]


def test_min_tokens_masks_eos_and_stop_tokens():
    row = torch.zeros(VOCAB)
    row[2], row[8], row[11] = 9.0, 8.0, 1.0  # 2 is EOS (helpers), 8 a stop token
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    assert sample([params], [row], outputs=[[1]]).token_ids == [11]
    assert sample([params], [row], outputs=[[1, 1]]).token_ids == [2]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and str(info.value).startswith(param)


# -- the sampler's pieces, against a full sort of the vocabulary -------------------------------------------------

WIDE_VOCAB = 1000  # flat rows of this width keep hundreds of tokens under top-p


def wide_rows() -> torch.Tensor:
    """(4, WIDE_VOCAB): two peaked rows (a real model's shape) and two flat ones (nucleus far above 256)."""
    generator = torch.Generator().manual_seed(11)
    peaked = torch.randn(2, WIDE_VOCAB, generator=generator) * 4
    flat = torch.randn(2, WIDE_VOCAB, generator=generator) * 0.3
    return torch.cat([peaked, flat])


def reference_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the settings define, by sorting the whole vocabulary (the definition, not the fast way)."""
    scaled = row / params.temperature
    ordered, order = scaled.sort(descending=True, stable=True)
    if params.top_k:
        ordered[params.top_k :] = float("-inf")
    probs = ordered.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < params.top_p if params.top_p < 1.0 else probs >= 0
    keep[0] = True
    probs = torch.where(keep, probs, 0.0)
    probs = torch.where(probs >= probs.max() * params.min_p, probs, 0.0)
    return torch.zeros_like(row).scatter(0, order, probs / probs.sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.9995),
    ],
    ids=["temperature", "top_k", "top_k_top_p", "top_p", "min_p", "top_p_min_p", "top_p_near_1"],
)
def test_the_candidates_hold_exactly_the_distribution_a_full_sort_defines(params: SamplingParams) -> None:
    from engine_core.sampler import _candidates, filtered_probs

    rows = wide_rows()
    batch = [params] * len(rows)
    candidates = _candidates(rows, batch, Workspace())
    probs = filtered_probs(candidates, batch)
    ids = candidates.token_ids if candidates.token_ids is not None else torch.arange(WIDE_VOCAB).expand_as(probs)
    for i, row in enumerate(rows):
        dense = torch.zeros(WIDE_VOCAB).index_add_(0, ids[i], probs[i])
        expected = reference_probs(row, params)
        assert torch.equal(dense > 0, expected > 0), "the kept tokens differ"
        torch.testing.assert_close(dense / dense.sum(), expected, atol=1e-6, rtol=1e-5)
    if params.top_p < 1.0 and not params.top_k:
        assert probs.shape[-1] > 256  # the flat rows' kept sets are wide


def test_wide_top_p_rows_get_candidates_only_two_buckets_past_the_kept_set() -> None:
    from engine_core.sampler import _candidates, filtered_probs
    from engine_core.sampling_candidates import BUCKET_NATS, NUCLEUS_WIDTH

    # the flat rows and a row 0.004 nats a step: all keep more than NUCLEUS_WIDTH tokens
    rows = torch.cat([wide_rows()[2:], torch.linspace(0.0, 4.0, WIDE_VOCAB)[None]])
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * len(rows)
    candidates = _candidates(rows, params, Workspace())
    assert candidates.token_ids is not None
    kept = filtered_probs(candidates, params) > 0  # (3, K)
    assert int(kept[2].sum()) == int((reference_probs(rows[2], params[2]) > 0).sum()) > NUCLEUS_WIDTH
    for i, row in enumerate(rows):
        last_kept = float(row[candidates.token_ids[i, kept[i]]].min())
        within = int((row >= last_kept - 2 * BUCKET_NATS).sum())  # the tokens of two more buckets, at most
        assert NUCLEUS_WIDTH < int(kept[i].sum()) <= int((candidates.probs[i] > 0).sum()) <= within


def test_the_pick_is_the_inverse_cdf_and_never_a_zero_weight_token() -> None:
    from engine_core.sampling_pick import pick

    probs = torch.tensor([[0.5, 0.3, 0.0, 0.2]] * 6 + [[0.0, 0.0, 0.0, 0.0]])
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.79, 0.81, 1 - 2**-53, 0.3], dtype=torch.float64)
    assert pick(probs, uniforms).tolist() == [0, 0, 1, 1, 3, 3, 0]
    weights = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # unnormalized; the last tokens have no weight
    assert pick(weights, torch.tensor([1 - 2**-53], dtype=torch.float64)).tolist() == [1]


def test_a_seeded_uniform_is_fixed_by_seed_and_position() -> None:
    from engine_core.sampler import _splitmix64, seeded_uniform

    assert _splitmix64(0) == 0xE220A8397B1DCDAF  # splitmix64's published first output from state 0
    # pinned: a change here changes every seeded stream a client has seen
    assert seeded_uniform(0, 0) == 0.6524484863740322
    assert seeded_uniform(1234, 7) == 0.6981341974772763
    assert seeded_uniform(-1, 0) == seeded_uniform(2**64 - 1, 0)  # a negative seed is its 64-bit pattern
    values = [seeded_uniform(seed, position) for seed in range(20) for position in range(20)]
    assert len(set(values)) == 400 and all(0.0 <= v < 1.0 for v in values)


def test_a_seeded_row_is_the_same_whatever_groups_share_its_batch() -> None:
    rows = wide_rows()
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),  # on a flat row: hundreds of candidates widen the group
        SamplingParams(temperature=0.5, min_p=0.2),
    ]
    for seed in range(10):
        for params in (
            SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=seed, repetition_penalty=1.2),
            SamplingParams(temperature=1.0, top_p=0.9, seed=seed),
            SamplingParams(temperature=0.8, seed=seed),
        ):
            for row in (0, 3):
                alone = sample([params], [rows[row]]).token_ids[0]
                crowded = sample(
                    [*others, params], [rows[2], rows[1], rows[3], rows[0], rows[row]], sampler=Sampler(seed)
                )
                assert crowded.token_ids[-1] == alone


def test_penalties_of_several_rows_apply_to_their_own_rows_only() -> None:
    from engine_core.sampler import _apply_penalties

    rows = torch.full((2, VOCAB), 1.0)
    first = make_request("a", [3, 3, 4], SamplingParams(repetition_penalty=2.0))
    second = make_request("b", [4], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    for t in (3, 3, 5):
        first.append_output_token(t)
        second.append_output_token(t)
    out = _apply_penalties(rows.clone(), [first, second])
    assert out[0, [3, 4, 5, 6]].tolist() == [0.5, 0.5, 0.5, 1.0]
    assert out[1, [3, 4, 5, 6]].tolist() == [1.0 - 0.5 - 0.5, 1.0, 1.0 - 0.5 - 0.25, 1.0]


def test_the_callers_logits_are_not_written() -> None:
    rows = torch.stack([logits_row(0), logits_row(1)])
    before = rows.clone()
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, min_tokens=3, stop_token_ids=[4])
    sample([params, params], list(rows), outputs=[[1, 4], [2]])
    requests = [make_request("r", [1, 2], params)]
    Sampler()(rows, requests)
    assert torch.equal(rows, before)


def test_the_two_level_pick_is_the_running_sums_pick_even_at_the_edges() -> None:
    from engine_core.sampling_pick import PICK_CHUNK, exact_pick, pick

    generator = torch.Generator().manual_seed(5)
    width = 40 * PICK_CHUNK + 77  # a shorter last chunk
    logits = torch.randn(6, width, generator=generator) * torch.tensor([[4.0], [4.0], [0.3], [0.3], [8.0], [1.0]])
    probs = logits.softmax(dim=-1)
    probs[5] = 0.0  # nothing left: the best (first) token
    probs[4, ::3] = 0.0  # zero weights between the others
    uniforms = torch.rand(200, 6, generator=generator, dtype=torch.float64)
    # targets exactly on the running sum's edges, where only the exact sum decides (the fallback's case)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    edges = torch.randint(0, width, (50, 6), generator=generator)
    on_edge = (cdf.gather(-1, edges.T).T / cdf[:, -1]).nan_to_num(0.0)
    for u in torch.cat([uniforms, on_edge, torch.zeros(1, 6), torch.full((1, 6), 1 - 2**-53)]):
        assert pick(probs, u).tolist() == exact_pick(probs, u).tolist()
    assert pick(probs, uniforms[0]).tolist()[5] == 0


PIN_VOCAB = 5000  # wide enough for the two-level pick and for top-p rows past NUCLEUS_WIDTH
PIN_SETTINGS = {
    "temperature": {"temperature": 0.8},
    "top_k": {"temperature": 0.8, "top_k": 50},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "typical": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1},
    "penalties": {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
}
# Drawn by the sampler of main at 5413cea (before the two-level pick and the reused tensors): a change here changes
# the tokens every seeded request gets. Three steps per setting, 8 rows: 4 peaked, 4 flat (top-p keeps thousands).
PINNED_TOKENS = {
    "temperature": [
        [2341, 4097, 3627, 4202, 2108, 3590, 3814, 1720],
        [2341, 2856, 3627, 3745, 1554, 4231, 3660, 383],
        [2341, 3984, 3627, 4202, 1799, 1958, 1987, 3519],
    ],
    "top_k": [
        [2341, 3642, 3627, 4202, 3675, 3756, 54, 4295],
        [2341, 2856, 3627, 4202, 535, 2728, 919, 1381],
        [2341, 3981, 3627, 2198, 408, 2392, 489, 2013],
    ],
    "top_p": [
        [2341, 4097, 3627, 4202, 2757, 4339, 684, 2477],
        [2341, 2856, 3627, 4202, 3619, 173, 1867, 2953],
        [2341, 3981, 3627, 2198, 3121, 310, 2800, 1212],
    ],
    "min_p": [
        [2341, 640, 3627, 4202, 448, 337, 1857, 3589],
        [2341, 4565, 3627, 4202, 2307, 82, 4077, 4123],
        [2341, 549, 3627, 4202, 1650, 2967, 2763, 2822],
    ],
    "typical": [
        [2341, 4285, 3627, 4202, 3675, 1648, 919, 4295],
        [2341, 2856, 3627, 4202, 3869, 4726, 2000, 1381],
        [2341, 640, 3627, 2198, 408, 4454, 489, 3286],
    ],
    "penalties": [
        [2341, 4097, 3627, 4202, 2109, 3590, 3815, 1721],
        [2341, 2856, 3627, 3745, 1555, 4231, 3661, 385],
        [2341, 3984, 3627, 4202, 1801, 1959, 1990, 3520],
    ],
    "mixed": [  # row i, step s: setting (i + s) mod 6 of the above
        [2341, 3642, 3627, 4202, 3675, 3590, 3814, 4295],
        [2341, 2856, 3627, 4202, 1555, 4231, 919, 2953],
        [2341, 549, 3627, 4202, 1799, 2392, 2800, 2822],
    ],
}


def pinned_batch(setting: str, step: int) -> list:
    names = list(PIN_SETTINGS)
    requests = []
    for i in range(8):
        kwargs = PIN_SETTINGS[names[(i + step) % len(names)] if setting == "mixed" else setting]
        request = make_request(f"r{i}", [i, 7 * i + 1, 99], SamplingParams(seed=100 * i + 7, **kwargs))
        for t in range(step + 2):
            request.append_output_token((13 * i + 31 * t) % PIN_VOCAB)
        requests.append(request)
    return requests


@pytest.mark.parametrize("setting", list(PINNED_TOKENS))
def test_seeded_tokens_stay_what_they_were(setting: str) -> None:
    generator = torch.Generator().manual_seed(2026)
    peaked = torch.randn(4, PIN_VOCAB, generator=generator) * 4
    rows = torch.cat([peaked, torch.randn(4, PIN_VOCAB, generator=generator) * 0.3])
    reused = Sampler()  # its reused tensors must not carry anything from one call to the next
    for step, expected in enumerate(PINNED_TOKENS[setting]):
        assert Sampler()(rows, pinned_batch(setting, step)).token_ids == expected
        assert reused(rows[: 3 + step], pinned_batch(setting, step)[: 3 + step]).token_ids == expected[: 3 + step]
        assert reused(rows, pinned_batch(setting, step)).token_ids == expected
