"""LoRA through peft: the exact trainable set, step 0 equal to the base, lm_head never wrapped,
and a training step that moves only the adapter."""

import copy

import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from dgemma.errors import DGemmaError
from dgemma.models.primitives import Linear
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.training.config import apply_overrides, load_config
from dgemma.training.lora import apply_lora, is_adapter_param, merge_lora, resolve_targets
from dgemma.training.trainer import TrainModule, build_model, build_objective, build_train_data, train_step

CFG = "configs/sft_sudoku_tiny.py"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SELFCOND = {"self_conditioning.pre_norm.weight", "self_conditioning.mlp.gate_proj.weight",
            "self_conditioning.mlp.up_proj.weight", "self_conditioning.mlp.down_proj.weight",
            "self_conditioning.post_norm.weight"}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and on a loaded 2-core machine two threads spin
    against each other (measured: 30x slower). The trainer also sets ``train.threads``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
                self_conditioning=True)
    return ModelConfig(**{**base, **kw})


def random_base(**kw) -> DiffusionGemma:
    """Every weight random, norms included, so an adapter that changed anything would show."""
    torch.manual_seed(0)
    model = DiffusionGemma(tiny_config(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def lora_names(layers: int, targets) -> set[str]:
    out = set()
    for i in range(layers):
        for t in targets:
            block = "self_attn" if t in ATTN else "mlp"
            out |= {f"model.layers.{i}.{block}.{t}.lora_A.default.weight",
                    f"model.layers.{i}.{block}.{t}.lora_B.default.weight"}
    return out


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_trainable_set_is_exactly_the_adapter_and_the_new_modules():
    model = apply_lora(random_base(), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    assert trainable(model) == lora_names(2, ATTN + MLP) | SELFCOND
    assert all(is_adapter_param(n) for n in trainable(model))

    model = apply_lora(random_base(), r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    assert trainable(model) == lora_names(2, ("q_proj", "v_proj")) | SELFCOND

    model = apply_lora(random_base(self_conditioning=False), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    assert trainable(model) == lora_names(2, ATTN + MLP)


def test_the_recipe_builder_trains_exactly_the_adapter():
    cfg = load_config(CFG)
    model, _ = build_model(cfg)
    assert trainable(model) == lora_names(cfg.model.num_hidden_layers, ATTN + MLP) | SELFCOND
    a = model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert a.shape == (cfg.lora.r, cfg.model.hidden_size)


def test_unknown_target_is_refused():
    assert resolve_targets("all-linear") == list(ATTN + MLP)
    with pytest.raises(DGemmaError, match="lm_head"):
        resolve_targets(["q_proj", "lm_head"])


def test_all_linear_never_wraps_lm_head_or_the_selfcond_block():
    model = apply_lora(random_base(), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert wrapped == {n.rsplit(".lora_", 1)[0] for n in lora_names(2, ATTN + MLP)}
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.self_conditioning.mlp.down_proj) is Linear  # the decoder's own, unwrapped


def test_step_zero_equals_the_base_exactly_in_fp64():
    base = random_base().double().eval()
    lora = apply_lora(copy.deepcopy(base), r=8, alpha=16.0, dropout=0.0, target_modules="all-linear").double().eval()
    q = lora.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.abs().sum() > 0 and q.lora_B["default"].weight.abs().sum() == 0
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(lora(ids), base(ids))
        signal = torch.randn(2, 20, 32, dtype=torch.float64)
        from dgemma.models.masks import TokenInfo

        info = TokenInfo.plain(2, 20)
        info.noisy = torch.ones_like(info.valid)
        assert torch.equal(lora(ids, info=info, selfcond=signal), base(ids, info=info, selfcond=signal))


def test_merge_folds_the_adapter_into_plain_linears():
    model = apply_lora(random_base().double(), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids)
        merge_lora(model)
        after = model(ids)
    assert not any(isinstance(m, LoraLayer) for m in model.modules())
    assert not any("lora" in n for n in model.state_dict())
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)


def test_a_training_step_changes_only_adapter_params():
    cfg = apply_overrides(load_config(CFG), ["--cfg.diffusion.selfcond_prob=1.0", "--cfg.data.batch_size=2"])
    model, tok = build_model(cfg)
    objective = build_objective(cfg, model, tok)
    data = build_train_data(cfg, tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    for step in range(2):  # B and the selfcond output start at zero: A and the rest move from step 2
        out = train_step(TrainModule(model, objective), [data.batch([2 * step, 2 * step + 1])], opt, step=step,
                         seed=0, rank=0, world=1, clip_norm=1.0, ar_weight=1.0, objective=objective)
        assert out["finite"]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable(model)  # every adapter matrix moved ...
    frozen = set(before) - trainable(model)
    assert frozen and not changed & frozen  # ... and nothing of the base did
