"""FlatLogprobs behaves like list[dict[int, Logprob]] for reading and appending."""

from __future__ import annotations

import pytest

from pagedlm.logprobs import (
    FlatLogprobs,
    Logprob,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)

POS0 = {1: Logprob(logprob=0.1, rank=10, decoded_token="10")}
POS1 = {
    2: Logprob(logprob=0.2, rank=20, decoded_token="20"),
    3: Logprob(logprob=0.3, rank=30, decoded_token="30"),
}
POS2 = {
    4: Logprob(logprob=0.4, rank=40, decoded_token="40"),
    5: Logprob(logprob=0.5, rank=50, decoded_token="50"),
    6: Logprob(logprob=0.6, rank=60, decoded_token="60"),
}


def test_logprob_defaults() -> None:
    lp = Logprob(-1.0)
    assert lp.rank is None and lp.decoded_token is None


def test_append_layout() -> None:
    flat = FlatLogprobs()
    flat.append(POS0)
    flat.append(POS1)
    flat.append(POS2)
    assert flat.start_indices == [0, 1, 3]
    assert flat.end_indices == [1, 3, 6]
    assert flat.token_ids == [1, 2, 3, 4, 5, 6]
    assert flat.logprobs == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert flat.ranks == [10, 20, 30, 40, 50, 60]
    assert flat.decoded_tokens == ["10", "20", "30", "40", "50", "60"]


def test_reads_like_a_list_of_dicts() -> None:
    flat = FlatLogprobs()
    flat.extend([POS0, POS1, POS2])
    assert len(flat) == 3
    assert flat[0] == POS0 and flat[1] == POS1 and flat[-1] == POS2
    assert list(flat) == [POS0, POS1, POS2]
    with pytest.raises(IndexError):
        flat[3]
    with pytest.raises(TypeError):
        flat["0"]  # type: ignore[call-overload]


def test_none_position_is_empty() -> None:
    flat = FlatLogprobs()
    flat.append(None)
    flat.append(POS1)
    assert len(flat) == 2 and flat[0] == {} and flat[1] == POS1


def test_slices() -> None:
    flat = FlatLogprobs()
    flat.extend([POS0, POS1, POS2])
    tail = flat[1:]
    assert isinstance(tail, FlatLogprobs)
    assert tail.start_indices == [0, 2] and tail.end_indices == [2, 5]
    assert list(tail) == [POS1, POS2]
    assert list(flat[:1]) == [POS0]
    assert len(flat[5:]) == 0
    assert list(flat[::2]) == [POS0, POS2]
    assert list(flat[::-1]) == [POS2, POS1, POS0]


def test_extend_with_flat() -> None:
    a = FlatLogprobs()
    a.append(POS0)
    b = FlatLogprobs()
    b.extend([POS1, POS2])
    a.extend(b)
    assert list(a) == [POS0, POS1, POS2]
    assert a.start_indices == [0, 1, 3] and a.end_indices == [1, 3, 6]


def test_mutation_is_rejected() -> None:
    flat = FlatLogprobs()
    flat.append(POS0)
    with pytest.raises(TypeError):
        flat[0] = POS1
    with pytest.raises(TypeError):
        del flat[0]
    with pytest.raises(TypeError):
        flat.insert(0, POS1)


def test_create_helpers() -> None:
    assert create_prompt_logprobs(False) == [None]
    prompt_flat = create_prompt_logprobs(True)
    assert isinstance(prompt_flat, FlatLogprobs) and len(prompt_flat) == 1
    assert create_sample_logprobs(False) == []
    sample_flat = create_sample_logprobs(True)
    assert isinstance(sample_flat, FlatLogprobs) and len(sample_flat) == 0


@pytest.mark.parametrize("flat", [False, True])
def test_append_for_next_position(flat: bool) -> None:
    container = create_sample_logprobs(flat)
    # Sampled token 7 (rank 3) followed by the top-2 candidates.
    append_logprobs_for_next_position(
        container, [7, 1, 2], [-2.0, -0.1, -0.5], ["c", "a", "b"], rank=3, num_logprobs=2
    )
    # Sampled token is also the top-1 candidate: one dict entry.
    append_logprobs_for_next_position(
        container, [1, 1, 2], [-0.1, -0.1, -0.5], ["a", "a", "b"], rank=1, num_logprobs=2
    )
    assert len(container) == 2
    assert container[0] == {
        7: Logprob(-2.0, 3, "c"),
        1: Logprob(-0.1, 1, "a"),
        2: Logprob(-0.5, 2, "b"),
    }
    assert container[1] == {1: Logprob(-0.1, 1, "a"), 2: Logprob(-0.5, 2, "b")}
    if flat:
        assert isinstance(container, FlatLogprobs)
        assert container.ranks == [3, 1, 2, 1, 1, 2]
