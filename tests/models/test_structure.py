"""Structure-aware canvas positions (``dgemma/models/structure.py``): the offset and group
arithmetic on literal values, which tokens they reach, the cache invariant, and their weights
travelling through checkpoints and ``save_hf``."""

import doctest

import pytest
import torch

from dgemma.data.sudoku import structure_groups
from dgemma.errors import DGemmaError
from dgemma.models import structure
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo, single_shot_info
from dgemma.models.structure import CanvasPositionGroups, canvas_offsets
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.training.checkpoint import check_compatible, model_fingerprint

V, C, N = 50, 4, 3
GROUPS = [[0, 0, 1, 1], [0, 1, 0, 1]]  # a 2x2 grid: rows, columns


def info_of(positions, blocks, noisy=None):
    positions, blocks = torch.tensor(positions), torch.tensor(blocks)
    noisy = torch.zeros_like(blocks, dtype=torch.bool) if noisy is None else torch.tensor(noisy).bool()
    return TokenInfo(positions, blocks, noisy, torch.ones_like(noisy))


def test_doctests():
    assert doctest.testmod(structure, extraglobs={"torch": torch}).failed == 0


def test_offsets_single_shot_layout():
    """[prompt | clean c0 c1 | noisy c0 c1], the second row's prompt right padded (3 -> 2 tokens)."""
    pvalid = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    info = single_shot_info(pvalid, torch.ones(2, 2 * 2, dtype=torch.bool), 2)
    assert info.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6],
                                       [0, 1, 1, 2, 3, 4, 5, 2, 3, 4, 5]]
    assert canvas_offsets(info).tolist() == [[0, 1, 2, 0, 1, 0, 1, 0, 1, 0, 1],
                                             [0, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1]]


def test_offsets_per_call_and_per_row():
    # a decoder pass of canvas 2 alone (positions continue after the cache), rows at different starts
    info = info_of([[9, 10, 11], [20, 21, 22]], [[3, 3, 3], [3, 3, 3]], [[1, 1, 1], [1, 1, 1]])
    assert canvas_offsets(info).tolist() == [[0, 1, 2], [0, 1, 2]]
    # blocks out of order and not contiguous in the call
    info = info_of([[7, 8, 0, 1, 4, 5]], [[5, 5, 0, 0, 2, 2]])
    assert canvas_offsets(info).tolist() == [[0, 1, 0, 1, 0, 1]]


def test_group_embeddings_literal():
    groups = CanvasPositionGroups(GROUPS, hidden_size=4).double()  # scaled by sqrt(4) = 2, as tokens are
    with torch.no_grad():
        groups[0].weight.copy_(torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0]]))  # rows
        groups[1].weight.copy_(torch.tensor([[0, 10.0, 0, 0], [0, 20.0, 0, 0]]))  # columns
    info = info_of([[0, 1, 2, 3, 4, 5]], [[0, 0, 1, 1, 1, 1]])  # 2 prompt tokens, one canvas of 4
    want = torch.tensor([[[0, 0, 0, 0], [0, 0, 0, 0], [2, 20, 0, 0], [2, 40, 0, 0], [4, 20, 0, 0],
                          [4, 40, 0, 0]]], dtype=torch.float64)
    assert torch.equal(groups(info), want)


def test_config_validation():
    with pytest.raises(ValueError, match="differ in length"):
        ModelConfig(canvas_position_groups=[[0, 1], [0]])
    with pytest.raises(ValueError, match=">= 0"):
        ModelConfig(canvas_position_groups=[[0, -1]])
    with pytest.raises(ValueError, match="at least one"):
        ModelConfig(canvas_position_groups=[])


def test_sudoku_groups():
    rows, cols, boxes = structure_groups()
    assert len(rows) == len(cols) == len(boxes) == 81
    for cell in range(81):
        r, c = divmod(cell, 9)
        assert (rows[cell], cols[cell], boxes[cell]) == (r, c, (r // 3) * 3 + c // 3)


def tiny(**kw):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                      sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      max_position_embeddings=128, **{"attn_implementation": "eager", **kw})
    torch.manual_seed(0)
    m = DiffusionGemma(cfg).double().eval()
    with torch.no_grad():  # make every norm matter, and the group embeddings as large as the tokens'
        for name, p in m.named_parameters():
            if p.dim() == 1 or name.startswith("canvas_groups."):
                p.normal_(0, 0.3)
    return m


def test_names_and_init():
    torch.manual_seed(0)
    m = DiffusionGemma(ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   canvas_position_groups=structure_groups()))
    tables = {n: p for n, p in m.named_parameters() if n.startswith("canvas_groups.")}
    assert {n: tuple(p.shape) for n, p in tables.items()} == {f"canvas_groups.{i}.weight": (9, 64) for i in range(3)}
    for p in tables.values():
        assert 0.01 < p.std().item() < 0.03  # reset_parameters' std 0.02
    assert "canvas_groups.group_ids" not in m.state_dict()  # the id table is config, not a weight


def test_unset_and_zero_groups_are_the_plain_model():
    plain = tiny()
    grouped = tiny(canvas_position_groups=GROUPS)
    assert plain.canvas_groups is None
    grouped.load_state_dict(plain.state_dict(), strict=False)  # building the tables moved the init RNG
    with torch.no_grad():
        for table in grouped.canvas_groups:
            table.weight.zero_()
    ids = torch.randint(0, V, (2, 5 + 2 * C), generator=torch.Generator().manual_seed(0))
    info = single_shot_info(torch.ones(2, 5, dtype=torch.bool), torch.ones(2, C, dtype=torch.bool), C)
    with torch.no_grad():
        assert torch.equal(grouped(ids, info=info), plain(ids, info=info))


def test_embeddings_reach_only_canvas_tokens():
    model = tiny(canvas_position_groups=GROUPS)
    ids = torch.randint(0, V, (2, 5 + 2 * C), generator=torch.Generator().manual_seed(0))
    info = single_shot_info(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool(),
                            torch.ones(2, C, dtype=torch.bool), C)
    with torch.no_grad():
        with_groups = model.embed(ids, info, None, None)
        groups, model.canvas_groups = model.canvas_groups, None
        without = model.embed(ids, info, None, None)
        prompt_only = model(ids[:, :5], info=info[:, :5])
        model.canvas_groups = groups
        assert torch.equal(model(ids[:, :5], info=info[:, :5]), prompt_only)  # the prompt never sees them
    changed = (with_groups != without).any(-1)
    assert changed.tolist() == (info.blocks >= 1).tolist()  # every canvas token, clean and noisy; no prompt
    # the clean and the noisy copy of the canvas get the same addition, offset by offset
    with torch.no_grad():
        added = model.canvas_groups(info)
    assert torch.equal(added[:, 5:5 + C], added[:, 5 + C:]) and added[:, 5:].abs().min() > 0
    torch.testing.assert_close(with_groups, without + added, rtol=0, atol=1e-15)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("encoder", ["causal", "block"])
def test_cached_equals_single_shot(attn, encoder):
    """docs/design.md §3's invariant with group embeddings: canvas by canvas through the cache (each canvas
    its own call) equals one forward over [prompt | clean canvases | noisy canvases], fp64."""
    model = tiny(canvas_position_groups=GROUPS, self_conditioning=True, attn_implementation=attn,
                 encoder_mode=encoder)
    g = torch.Generator().manual_seed(1)
    pvalid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).bool()
    prompt = torch.randint(0, V, (2, 5), generator=g)
    clean = torch.randint(0, V, (2, N * C), generator=g)
    noisy = torch.randint(0, V, (2, N * C), generator=g)
    selfcond = torch.randn(2, N * C, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        cache = KVCache(2, 5 + N * C)
        model(prompt, info=TokenInfo.clean(pvalid), cache=cache)
        start, outs = pvalid.sum(-1), []
        for k in range(N):
            pos = start[:, None] + k * C + torch.arange(C)[None]
            blk, ones = torch.full((2, C), k + 1), torch.ones(2, C, dtype=torch.bool)
            part = slice(k * C, (k + 1) * C)
            outs.append(model(noisy[:, part], info=TokenInfo(pos, blk, ones, ones), cache=cache, write=False,
                              selfcond=selfcond[:, part]))
            model(clean[:, part], info=TokenInfo(pos, blk, ~ones, ones), cache=cache)
        got = torch.cat(outs, 1)
        info = single_shot_info(pvalid, torch.ones(2, N * C, dtype=torch.bool), C)
        sc = torch.cat([torch.zeros(2, 5 + N * C, 32, dtype=torch.float64), selfcond], 1)
        want = model(torch.cat([prompt, clean, noisy], 1), info=info, selfcond=sc)[:, -N * C:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)  # 1 ulp of summation order, as in test_cache


def test_fingerprint_and_compatibility():
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    plain, grouped = ModelConfig(**base), ModelConfig(**base, canvas_position_groups=GROUPS)
    assert "canvas_position_groups" not in model_fingerprint(plain)  # prints of older checkpoints unchanged
    assert model_fingerprint(grouped)["canvas_position_groups"] == GROUPS
    check_compatible({"model_fingerprint": model_fingerprint(grouped)}, grouped)
    with pytest.raises(DGemmaError, match="canvas_position_groups=None; this config has canvas_position_groups=<2"):
        check_compatible({"model_fingerprint": model_fingerprint(plain)}, grouped)
    with pytest.raises(DGemmaError, match="canvas_position_groups"):
        check_compatible({"model_fingerprint": model_fingerprint(grouped)}, plain)


def test_save_hf_round_trip(tmp_path):
    from dgemma.models.weights import EXTRAS_FILE, save_hf
    from dgemma.models.pretrained import load_pretrained
    from safetensors.torch import load_file

    model = tiny(canvas_position_groups=GROUPS).float()
    save_hf(model, None, tmp_path)
    assert "canvas_groups.0.weight" in load_file(tmp_path / EXTRAS_FILE)
    back, _ = load_pretrained(tmp_path, attn_implementation="eager")
    assert back.config.canvas_position_groups == GROUPS
    for name, p in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name
    ids = torch.randint(0, V, (1, 5 + C))
    info = single_shot_info(torch.ones(1, 5, dtype=torch.bool), torch.ones(1, C, dtype=torch.bool), C)[:, :5 + C]
    with torch.no_grad():
        assert torch.equal(back(ids, info=info), model(ids, info=info))
