"""Masks asserted as literal matrices (1 = may attend)."""

import torch

from dgemma.models.masks import (
    TokenInfo,
    block_causal_mask,
    canvas_decode_mask,
    causal_mask,
    dense_mask,
    single_shot_info,
    sliding_window_mask,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.int32)


def test_causal():
    p = torch.arange(4)
    assert torch.equal(causal_mask(p[:, None], p[None, :]).int(), t(
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 1, 1, 0],
         [1, 1, 1, 1]]))


def test_sliding_window_is_exclusive_and_symmetric():
    p = torch.arange(5)
    assert torch.equal(sliding_window_mask(p[:, None], p[None, :], 3).int(), t(
        [[1, 1, 1, 0, 0],
         [1, 1, 1, 1, 0],
         [1, 1, 1, 1, 1],
         [0, 1, 1, 1, 1],
         [0, 0, 1, 1, 1]]))


def test_block_causal():
    b = torch.tensor([0, 0, 1, 1, 2])
    assert torch.equal(block_causal_mask(b[:, None], b[None, :]).int(), t(
        [[1, 1, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 1, 1, 1, 0],
         [1, 1, 1, 1, 0],
         [1, 1, 1, 1, 1]]))


def test_canvas_decode():
    # keys: prompt(2) | clean c0(2) | clean c1(2) | noisy c0(2) | noisy c1(2); queries: noisy c0, c1
    kb = torch.tensor([0, 0, 1, 1, 2, 2, 1, 1, 2, 2])
    kn = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1]).bool()
    qb = torch.tensor([1, 1, 2, 2])
    assert torch.equal(canvas_decode_mask(qb[:, None], kb[None, :], kn[None, :]).int(), t(
        [[1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
         [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
         [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
         [1, 1, 1, 1, 0, 0, 0, 0, 1, 1]]))


def test_single_shot_causal_encoder_with_padding():
    # row: prompt [a b _] (one pad), one canvas of 2: layout [a b _ | c0 c0 | ~c0 ~c0]
    info = single_shot_info(torch.tensor([[1, 1, 0]]).bool(), torch.tensor([[1, 1]]).bool(), canvas_size=2)
    assert info.positions.tolist() == [[0, 1, 1, 2, 3, 2, 3]]
    m = dense_mask(info, info, encoder="causal", window=None)[0].int()
    assert torch.equal(m, t(
        [[1, 0, 0, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0, 0],
         [1, 1, 1, 0, 0, 0, 0],   # the pad query sees itself (no empty row); real queries never see it
         [1, 1, 0, 1, 0, 0, 0],
         [1, 1, 0, 1, 1, 0, 0],
         [1, 1, 0, 0, 0, 1, 1],
         [1, 1, 0, 0, 0, 1, 1]]))


def test_single_shot_block_encoder_with_window():
    info = single_shot_info(torch.ones(1, 2).bool(), torch.ones(1, 4).bool(), canvas_size=2)
    m = dense_mask(info, info, encoder="block", window=3)[0].int()
    # positions: p 0 1 | c 2 3 4 5 | n 2 3 4 5
    assert torch.equal(m, t(
        [[1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
         [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
         [0, 1, 1, 1, 0, 0, 0, 0, 0, 0],
         [0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
         [0, 0, 0, 1, 1, 1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
         [0, 1, 0, 0, 0, 0, 1, 1, 0, 0],
         [0, 0, 1, 1, 0, 0, 0, 0, 1, 1],
         [0, 0, 0, 1, 0, 0, 0, 0, 1, 1]]))


def test_canvas_anchored_window_ends_at_the_canvas_start():
    """DiffusionGemma's decoder window: every noisy token sees the ``window - 1`` tokens before
    its canvas and its whole canvas, whatever its offset (clean tokens keep the usual window)."""
    info = single_shot_info(torch.ones(1, 3).bool(), torch.ones(1, 4).bool(), canvas_size=2)
    m = dense_mask(info, info, encoder="causal", window=2, anchor="canvas")[0].int()
    # positions: p 0 1 2 | c 3 4 5 6 | n 3 4 5 6
    assert torch.equal(m, t(
        [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
         [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
         [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0],
         [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
         [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
         [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
         [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0],
         [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0],
         [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1],
         [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1]]))
    query = dense_mask(info, info, encoder="causal", window=2)[0].int()
    assert query[8].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]  # the per-query window loses p2 at offset 1


def test_clean_positions_skip_padding():
    info = TokenInfo.clean(torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool(), start=torch.tensor([0, 3]))
    assert info.positions.tolist() == [[0, 1, 2, 2, 2], [3, 3, 3, 3, 3]]


def test_docstring_examples():
    import doctest

    import dgemma.models.masks as masks

    assert doctest.testmod(masks, extraglobs={"torch": torch}).failed == 0


def test_rotary_table_stays_fp32_whatever_the_model_dtype():
    from dgemma.models.primitives import Rotary

    a, b = Rotary(16, 10_000.0, 4096), Rotary(16, 10_000.0, 4096).to(torch.bfloat16)
    pos = torch.tensor([[0, 7, 511, 3000]])
    ca, sa = a(pos, torch.float32)
    cb, sb = b(pos, torch.float32)
    assert torch.equal(ca, cb) and torch.equal(sa, sb)
