"""Hand-worked checks of the engine's logits processing, sampling and stop
matching (no model involved)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sao.rollout.embedded.sampling import (
    StopStringMatcher,
    default_stop_ids,
    sample_tokens,
    sampling_logprobs,
)

NEG_INF = float("-inf")


def _process(
    logits: list[list[float]], temperature: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    return sampling_logprobs(
        torch.tensor(logits),
        torch.tensor(temperature),
        torch.tensor(top_k),
        torch.tensor(top_p),
    )


def test_top_k_then_top_p_renormalises_by_hand() -> None:
    # logits (2, 1, 0, -1) in shuffled order (0, 2, -1, 1).
    # softmax: e^2, e^1, e^0, e^-1 over 11.475 = (.6439, .2369, .0871, .0321)
    # top_k=3 drops e^-1 and renormalises over 11.107: (.6652, .2447, .0900)
    # top_p=.8: mass before each = (0, .6652, .9100) -> keep the first two
    # renormalised: e^2/(e^2+e) = 1/(1+e^-1) = .7311, and .2689
    logp = _process([[0.0, 2.0, -1.0, 1.0]], [1.0], [3], [0.8])[0]
    assert logp[0] == NEG_INF and logp[2] == NEG_INF
    assert logp[1].item() == pytest.approx(-math.log(1 + math.exp(-1)), abs=1e-6)  # -0.3133
    assert logp[3].item() == pytest.approx(-math.log(1 + math.exp(1)), abs=1e-6)  # -1.3133


def test_temperature_only_is_log_softmax_of_scaled_logits() -> None:
    # logits (1, 0, -1) at T=2 -> (0.5, 0, -0.5); normaliser log(e^.5 + 1 + e^-.5) = 1.1459
    logp = _process([[1.0, 0.0, -1.0]], [2.0], [0], [1.0])[0]
    z = math.log(math.exp(0.5) + 1 + math.exp(-0.5))
    assert logp.tolist() == pytest.approx([0.5 - z, -z, -0.5 - z], abs=1e-6)


def test_top_k_keeps_ties_and_rows_are_independent() -> None:
    # row 0: top_k=1 with a tie at the top keeps both maxima: log(1/2) each.
    # row 1: no filter, must equal the plain log_softmax although row 0 filters.
    # row 2: top_p tiny keeps only the most likely token: log 1 = 0.
    logits = [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 3.0, 1.0]]
    logp = _process(logits, [1.0, 1.0, 1.0], [1, 0, 0], [1.0, 1.0, 0.01])
    assert logp[0].tolist() == pytest.approx([math.log(0.5), math.log(0.5), NEG_INF])
    assert torch.allclose(logp[1], torch.log_softmax(torch.tensor(logits[1]), -1))
    assert logp[2].tolist() == [NEG_INF, 0.0, NEG_INF]


def test_top_k_alone_keeps_ties_without_a_full_sort() -> None:
    # no row uses top-p: the k-th largest comes from torch.topk. Row 0: top_k=1
    # with a tie keeps both maxima; row 1: top_k=2 of (3, 1, 1, 0) keeps 3 and
    # both 1s (ties at the boundary): softmax over (3, 1, 1); row 2: unfiltered.
    logits = [[1.0, 1.0, 0.0, -1.0], [1.0, 3.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]]
    logp = _process(logits, [1.0, 1.0, 1.0], [1, 2, 0], [1.0, 1.0, 1.0])
    assert logp[0].tolist() == pytest.approx([math.log(0.5), math.log(0.5), NEG_INF, NEG_INF])
    z = math.log(math.exp(3) + 2 * math.exp(1))
    assert logp[1].tolist() == pytest.approx([1 - z, 3 - z, NEG_INF, 1 - z], abs=1e-6)
    assert torch.allclose(logp[2], torch.log_softmax(torch.tensor(logits[2]), -1))


@given(
    st.integers(1, 6),
    st.integers(2, 40),
    st.integers(0, 2**31 - 1),
)
def test_top_k_fast_path_equals_the_sorted_path(rows: int, vocab: int, seed: int) -> None:
    # rows are independent, so the same rows with one extra top-p row (which
    # sends the whole batch through the sorting path) must come out the same
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # many ties
    top_k = torch.randint(0, vocab + 2, (rows,), generator=g)
    temperature = torch.rand(rows, generator=g) + 0.5
    fast = sampling_logprobs(logits, temperature, top_k, torch.ones(rows))
    slow = sampling_logprobs(
        torch.cat([logits, logits[:1]]),
        torch.cat([temperature, temperature[:1]]),
        torch.cat([top_k, torch.zeros(1, dtype=top_k.dtype)]),
        torch.cat([torch.ones(rows), torch.tensor([0.5])]),
    )[:rows]
    assert torch.equal(fast.isinf(), slow.isinf())
    assert torch.allclose(fast, slow, atol=1e-6)


def test_top_p_boundary_is_strict() -> None:
    # probs (.5, .25, .25) from logits log(2), 0, 0: with top_p=.5 the mass before
    # the second token is exactly .5, not < .5, so only the first token is kept.
    logits = [[math.log(2.0), 0.0, 0.0]]
    assert _process(logits, [1.0], [0], [0.5])[0].tolist() == [0.0, NEG_INF, NEG_INF]
    # top_p=.6: the second token (mass before .5 < .6) is kept, the third
    # (mass before .75) is not; renormalised (2/3, 1/3).
    kept = _process(logits, [1.0], [0], [0.6])[0].tolist()
    assert kept == pytest.approx([math.log(2 / 3), math.log(1 / 3), NEG_INF])


def test_sample_tokens_inverts_the_cdf_and_skips_zero_mass() -> None:
    # probs (.2, 0, .5, .3): cdf (.2, .2, .7, 1.0)
    logp = torch.log(torch.tensor([0.2, 0.0, 0.5, 0.3]))
    u = torch.tensor([0.0, 0.1, 0.2, 0.5, 0.75, 0.999])
    tokens, token_logp = sample_tokens(logp.expand(len(u), 4), u)
    assert tokens.tolist() == [0, 0, 2, 2, 3, 3]  # u=.2 lands past the empty token 1
    assert torch.equal(token_logp, logp[tokens])
    # a uniform grid of 1000 draws reproduces the probabilities to one count
    grid = (torch.arange(1000) + 0.5) / 1000
    counts = torch.bincount(sample_tokens(logp.expand(1000, 4), grid)[0], minlength=4)
    assert (counts - torch.tensor([200, 0, 500, 300])).abs().max() <= 1


class _CharTok:
    """decode = concatenation of characters; ids index into ``chars``."""

    def __init__(self, chars: str) -> None:
        self.chars = chars

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class _ByteTok:
    """decode = UTF-8 bytes with replacement, like byte-level tokenizers."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_string_matcher_spans_tokens() -> None:
    tok = _CharTok("helo wrd")
    matcher = StopStringMatcher(tok, ["lo w", "zz"])
    hits = [matcher.push(tok.chars.index(ch)) for ch in "hello world"]
    # "hello w" is the first prefix that contains "lo w": index 6
    assert hits.index(True) == 6
    assert matcher.text == "hello world"


def test_stop_string_matcher_waits_for_complete_characters() -> None:
    # "é" is two bytes c3 a9; the first byte alone decodes to U+FFFD and must not count
    matcher = StopStringMatcher(_ByteTok(), ["é"])
    assert matcher.push(ord("a")) is False
    assert matcher.push(0xC3) is False
    assert matcher.text == "a"
    assert matcher.push(0xA9) is True
    assert matcher.text == "aé"


def test_default_stop_ids_order_of_sources() -> None:
    gen = SimpleNamespace(eos_token_id=[5, 6])
    cfg = SimpleNamespace(eos_token_id=7)
    tok = SimpleNamespace(eos_token_id=8)
    assert default_stop_ids(cfg, gen, tok) == (5, 6)
    assert default_stop_ids(cfg, SimpleNamespace(eos_token_id=None), tok) == (7,)
    assert default_stop_ids(SimpleNamespace(), None, tok) == (8,)
    assert default_stop_ids(SimpleNamespace(eos_token_id=None), None, None) == ()
