import pytest
import torch

from dgemma.data.chunker import Canvases, chunk_response, collate_canvases
from dgemma.errors import DGemmaError

EOS, PAD = 1, 0


def chunk(tokens, num_canvases=3, canvas_size=2):
    return chunk_response(tokens, num_canvases=num_canvases, canvas_size=canvas_size, eos_id=EOS,
                          pad_id=PAD)


def assert_canvases(c, tokens, canvas_mask, valid, canvas_id=(0, 0, 1, 1, 2, 2)):
    assert c.tokens.dtype == torch.long and c.canvas_id.dtype == torch.long
    assert c.canvas_mask.dtype == torch.bool and c.valid.dtype == torch.bool
    assert c.tokens.tolist() == tokens
    assert c.canvas_mask.tolist() == canvas_mask
    assert c.valid.tolist() == valid
    assert c.canvas_id.tolist() == list(canvas_id)


def test_eos_fills_rest_of_last_canvas_and_later_canvases_are_pad():
    assert_canvases(chunk([5, 6, 7]), [5, 6, 7, 1, 0, 0], [True, True, False],
                    [True, True, True, True, False, False])


def test_one_token_short_of_capacity_ends_with_one_eos():
    assert_canvases(chunk([5, 6, 7, 8, 9]), [5, 6, 7, 8, 9, 1], [True, True, True], [True] * 6)


def test_response_ending_on_a_boundary_gets_a_canvas_of_eos():
    assert_canvases(chunk([5, 6]), [5, 6, 1, 1, 0, 0], [True, True, False],
                    [True, True, True, True, False, False])


def test_truncation_keeps_first_tokens_and_adds_no_eos():
    assert_canvases(chunk([5, 6, 7, 8, 9, 4, 3, 2]), [5, 6, 7, 8, 9, 4], [True] * 3, [True] * 6)


def test_exactly_full_response_has_no_eos():
    assert_canvases(chunk([5, 6, 7, 8, 9, 4]), [5, 6, 7, 8, 9, 4], [True] * 3, [True] * 6)


def test_empty_response_is_one_canvas_of_eos():
    assert_canvases(chunk([]), [1, 1, 0, 0, 0, 0], [True, False, False],
                    [True, True, False, False, False, False])


def test_canvas_size_one_and_uneven_layout():
    c = chunk([5], num_canvases=3, canvas_size=1)
    assert_canvases(c, [5, 1, 0], [True, True, False], [True, True, False], canvas_id=(0, 1, 2))
    c = chunk([5, 6, 7, 8], num_canvases=2, canvas_size=3)
    assert_canvases(c, [5, 6, 7, 8, 1, 1], [True, True], [True] * 6, canvas_id=(0, 0, 0, 1, 1, 1))


def test_accepts_tensor_input():
    assert chunk(torch.tensor([5, 6, 7])).tokens.tolist() == [5, 6, 7, 1, 0, 0]


@pytest.mark.parametrize("kw", [dict(num_canvases=0, canvas_size=2), dict(num_canvases=2, canvas_size=0)])
def test_bad_sizes_raise(kw):
    with pytest.raises(DGemmaError):
        chunk_response([5], eos_id=EOS, pad_id=PAD, **kw)


def test_collate_stacks_fields():
    batch = collate_canvases([chunk([5, 6, 7]), chunk([]), chunk(list(range(10, 20)))])
    assert set(batch) == {"tokens", "canvas_id", "canvas_mask", "valid"}
    assert batch["tokens"].tolist() == [[5, 6, 7, 1, 0, 0], [1, 1, 0, 0, 0, 0],
                                        [10, 11, 12, 13, 14, 15]]
    assert batch["canvas_mask"].tolist() == [[True, True, False], [True, False, False],
                                             [True, True, True]]
    assert batch["valid"].sum(1).tolist() == [4, 2, 6]
    assert batch["canvas_id"].shape == (3, 6) and batch["canvas_id"][2].tolist() == [0, 0, 1, 1, 2, 2]


def test_collate_rejects_mismatched_layouts_and_empty_batches():
    with pytest.raises(DGemmaError):
        collate_canvases([chunk([5]), chunk([5], num_canvases=2)])
    with pytest.raises(DGemmaError):
        collate_canvases([])
    assert isinstance(chunk([5]), Canvases)
