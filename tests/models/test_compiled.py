"""``dgemma/models/compiled.py:CompiledModel``: the compiled forward decodes what the eager one
decodes (fp32, a tiny model with self-conditioning, sliding and global layers, the KV cache), and
the growing cache compiles each kind of call once (dynamic shapes). Compiling takes tens of
seconds on a CPU, hence ``slow``'s neighbour: one test, every call kind in it."""

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import CanvasSampler, ar_generate
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import CommitStep
from dgemma.models.compiled import CompiledModel
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V = 64


def tiny() -> DiffusionGemma:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                      self_conditioning=True)
    torch.manual_seed(0)
    return DiffusionGemma(cfg).eval()


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_compiled_decoding_equals_eager_and_compiles_each_kind_once(one_thread):
    model = tiny()
    compiled = CompiledModel(model)
    assert compiled.config is model.config and compiled.logits == model.logits  # attributes are the model's
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, 9), generator=g)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :3] = False  # left padding in one row
    noise = AbsorbingNoise(2, LinearSchedule())
    sampler = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0),
                            num_steps=4, canvas_size=8, max_canvases=3, temperature=0.0)
    with torch.no_grad():
        want = sampler(model, ids, valid, generator=torch.Generator().manual_seed(0))
        got = sampler(compiled, ids, valid, generator=torch.Generator().manual_seed(0))
        assert got.tokens == want.tokens and got.forward_passes == want.forward_passes
        kinds = compiled.compiles
        assert kinds >= 2 and compiled.compile_s > 0
        # three more canvases: the cache is longer, nothing recompiles
        sampler.max_canvases = 6
        assert sampler(compiled, ids, valid, generator=torch.Generator().manual_seed(0)).tokens == \
            sampler(model, ids, valid, generator=torch.Generator().manual_seed(0)).tokens
        assert compiled.compiles == kinds
        ar_want = ar_generate(model, ids, valid, max_new_tokens=12)
        ar_got = ar_generate(compiled, ids, valid, max_new_tokens=12)
        assert ar_got.tokens == ar_want.tokens
    with pytest.raises(ValueError, match="never written"):
        from dgemma.models.masks import TokenInfo
        info = TokenInfo.clean(valid)
        info.noisy = torch.ones_like(valid)
        compiled(ids, info=info, write=True)
