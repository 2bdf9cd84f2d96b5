"""Corpus pipeline: readers, BPE, shards + manifest, windows, sampler, Lite batches, CLI."""

import json
import random

import numpy as np
import pytest
import torch

from dgemma.cli.main import main
from dgemma.data import corpus as C
from dgemma.data import documents as D
from dgemma.data import windows as W
from dgemma.data.tokenizers import load_tokenizer
from dgemma.errors import DGemmaError

WORDS = ("the cat sat on a mat while dogs ran over green hills and birds sang under blue skies "
         "quickly slowly ünïcödé naïve café").split()


def sentence(rng, k=None):
    return " ".join(rng.choices(WORDS, k=k or rng.randint(3, 40)))


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("bpe") / "tok"
    C.train_bpe_tokenizer((sentence(rng) for _ in range(400)), 300, out_path=folder)
    return folder


# -- readers ----------------------------------------------------------------------------------
def test_txt_documents_are_blank_line_blocks(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("line one\nline two\n\n\nsecond doc\n  \t\nthird\r\nstill third\n")
    stats = D.ReadStats()
    assert list(D.read_txt(p, stats=stats)) == ["line one\nline two", "second doc", "third\r\nstill third"]
    assert (stats.documents, stats.bytes) == (3, p.stat().st_size)
    p.write_text("aaaa\nbbbb\ncccc\n")
    assert list(D.read_txt(p, max_doc_chars=10)) == ["aaaa\nbbbb", "cccc"]


def test_jsonl_field_and_broken_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"body": "first"}\n\n{"body": "second"\n{"other": 1}\n[1, 2]\n{"body": "  "}\n{"body": "last"}\n')
    with pytest.raises(DGemmaError, match=rf"{p}:3: invalid JSON"):
        list(D.read_jsonl(p, text_field="body"))
    stats = D.ReadStats()
    assert list(D.read_jsonl(p, text_field="body", on_error="skip", stats=stats)) == ["first", "last"]
    assert stats.skipped == 3 and stats.empty == 1 and stats.bytes == p.stat().st_size
    assert [e.split(": ")[0] for e in stats.errors] == [f"{p}:3", f"{p}:4", f"{p}:5"]
    assert "no string field 'body'" in stats.errors[1] and "not a JSON object" in stats.errors[2]
    with pytest.raises(DGemmaError, match="on_error must be"):
        list(D.read_jsonl(p, on_error="ignore"))


def test_parquet_reads_in_batches(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "a.parquet"
    texts = [f"doc {i}" for i in range(50)]
    texts[7] = None
    pq.write_table(pa.table({"text": texts, "n": list(range(50))}), p, row_group_size=8)
    with pytest.raises(DGemmaError, match=rf"{p}:row 8: null 'text'"):
        list(D.read_parquet(p, batch_rows=5))
    stats = D.ReadStats()
    got = list(D.read_parquet(p, on_error="skip", stats=stats, batch_rows=5))
    assert got == [t for t in texts if t is not None]
    assert stats.skipped == 1 and stats.bytes == p.stat().st_size
    with pytest.raises(DGemmaError, match="no column 'body'"):
        list(D.read_parquet(p, text_field="body"))
    with pytest.raises(DGemmaError, match="has type int64, expected a string"):
        list(D.read_parquet(p, text_field="n"))


def test_inputs_paths_folders_globs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    a = write_jsonl(tmp_path / "d" / "a.jsonl", ["x"])
    b = tmp_path / "d" / "sub" / "b.txt"
    b.write_text("y\n")
    (tmp_path / "d" / "notes.md").write_text("ignored inside a folder")
    (tmp_path / "d" / ".hidden.txt").write_text("hidden")
    assert D.resolve_inputs(tmp_path / "d") == [a, b]
    assert D.resolve_inputs([str(tmp_path / "d" / "**" / "*.txt"), a, str(a)]) == [b, a]
    assert list(D.iter_documents([tmp_path / "d"])) == ["x", "y"]
    with pytest.raises(DGemmaError, match="unknown extension '.md'"):
        D.resolve_inputs(tmp_path / "d" / "notes.md")
    with pytest.raises(DGemmaError, match="no files match"):
        D.resolve_inputs(str(tmp_path / "*.parquet"))
    with pytest.raises(DGemmaError, match="no such file"):
        D.resolve_inputs(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DGemmaError, match="no .txt, .jsonl, .parquet files under"):
        D.resolve_inputs(tmp_path / "empty")


# -- tokenizer --------------------------------------------------------------------------------
def test_bpe_tiny_vocab_round_trips(bpe):
    tok = load_tokenizer(bpe)
    assert tok.vocab_size == 300
    assert [tok.token_to_id(t) for t in C.SPECIAL_TOKENS] == [C.PAD_ID, C.EOS_ID, C.BOS_ID, C.MASK_ID] == [0, 1, 2, 3]
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    for text in ["the cat sat on a mat", "  leading spaces\n\ttabs and\r\nnewlines ", "unseen: Ωmega 🚀 x²"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert len(tok.encode("the cat sat on a mat")) < len("the cat sat on a mat".encode())  # merges learnt
    with pytest.raises(DGemmaError, match="at least 260"):
        C.train_bpe_tokenizer(["x"], 100, out_path=bpe.parent / "small")


def test_bpe_char_cap(tmp_path):
    C.train_bpe_tokenizer(iter(["ab" * 1000, "cd" * 1000]), 300, out_path=tmp_path / "t" / "tokenizer.json",
                          max_chars=1000)
    tok = load_tokenizer(tmp_path / "t")
    assert tok.token_to_id("abab") is not None and tok.token_to_id("cdcd") is None  # second text never seen
    with pytest.raises(DGemmaError, match="a folder or a path named tokenizer.json"):
        C.train_bpe_tokenizer(["x"], 300, out_path=tmp_path / "vocab.json")


# -- shards, manifest, windows ----------------------------------------------------------------
def stream(folder, split, manifest):
    dtype = np.dtype(manifest["dtype"])
    return np.concatenate([np.fromfile(folder / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]])


def test_shards_manifest_and_windows(tmp_path, bpe):
    rng = random.Random(1)
    docs = [sentence(rng) for _ in range(60)]
    write_jsonl(tmp_path / "a.jsonl", docs[:40])
    (tmp_path / "b.txt").write_text("\n\n".join(docs[40:]) + "\n")
    out = tmp_path / "out"
    m = C.prepare_corpus([tmp_path / "a.jsonl", tmp_path / "b.txt"], tokenizer=bpe, out_dir=out, shard_tokens=97,
                         workers=0, val_fraction=0.25, progress=False)
    tok = load_tokenizer(bpe)
    encoded = [tok.encode(d) + [tok.eos_id] for d in docs]
    is_val = [(i + 1) // 4 > i // 4 for i in range(60)]  # every 4th document
    expected = {"train": [t for d, v in zip(encoded, is_val) for t in d if not v],
                "val": [t for d, v in zip(encoded, is_val) for t in d if v]}
    assert m["dtype"] == "uint16" and m["vocab_size"] == 300 and m["eos_id"] == 1
    assert m["documents"] == 60 and m["splits"]["val"]["documents"] == 15
    assert m["total_tokens"] == sum(map(len, encoded)) == m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    assert m["tokenizer"]["sha256"] == C._sha256(bpe / "tokenizer.json") and not m["tokenizer"]["trained"]
    assert m == json.loads((out / "manifest.json").read_text())
    for split in ("train", "val"):
        shards = m["splits"][split]["shards"]
        assert [s["file"] for s in shards] == [f"{split}_{k:05d}.bin" for k in range(len(shards))]
        assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
        assert sum(s["tokens"] for s in shards) == m["splits"][split]["tokens"] == len(expected[split])
        assert all((out / s["file"]).stat().st_size == 2 * s["tokens"] for s in shards)
        assert stream(out, split, m).tolist() == expected[split]
    assert len(m["splits"]["train"]["shards"]) > 3

    windows = W.TokenWindows(out, "train", seq_len=10)  # 10 does not divide 97: windows span shards
    assert len(windows) == len(expected["train"]) // 10
    flat = torch.cat([windows[i] for i in range(len(windows))])
    assert flat.dtype == torch.long and flat.tolist() == expected["train"][: len(windows) * 10]
    assert windows[-1].tolist() == windows[len(windows) - 1].tolist()
    with pytest.raises(IndexError):
        windows[len(windows)]
    with pytest.raises(DGemmaError, match="fewer than one window"):
        W.TokenWindows(out, "val", seq_len=10_000)


def test_shard_dtype_boundary_and_uint32_ids(tmp_path):
    assert C.shard_dtype(65536) == np.uint16 and C.shard_dtype(65537) == np.uint32
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    backend.save(str(tmp_path / "tok" / "tokenizer.json"))
    write_jsonl(tmp_path / "a.jsonl", ["w5 w65535 w65536", "w69999 w3"])
    m = C.prepare_corpus(tmp_path / "a.jsonl", tokenizer=tmp_path / "tok" / "tokenizer.json", out_dir=tmp_path / "o",
                         workers=0, val_fraction=0.0, progress=False)
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_000 and m["splits"]["val"]["tokens"] == 0
    assert stream(tmp_path / "o", "train", m).tolist() == [5, 65535, 65536, 1, 69999, 3, 1]
    assert (tmp_path / "o" / "train_00000.bin").stat().st_size == 4 * 7


def test_crash_leaves_no_manifest_and_damage_is_detected(tmp_path, bpe):
    rng = random.Random(2)
    p = write_jsonl(tmp_path / "a.jsonl", [sentence(rng) for _ in range(50)])
    with open(p, "a") as f:
        f.write("{broken\n")
    out = tmp_path / "out"
    with pytest.raises(DGemmaError, match=":51: invalid JSON"):
        C.prepare_corpus(p, tokenizer=bpe, out_dir=out, shard_tokens=50, workers=0, batch_chars=200, progress=False)
    assert list(out.glob("train_*.bin")) and not (out / "manifest.json").exists()  # shards, but no lying manifest
    with pytest.raises(DGemmaError, match="no manifest.json"):
        W.TokenWindows(out, "train", 8)
    with pytest.raises(DGemmaError, match="already holds a prepared corpus"):
        C.prepare_corpus(p, tokenizer=bpe, out_dir=out, workers=0, progress=False)
    m = C.prepare_corpus(p, tokenizer=bpe, out_dir=out, shard_tokens=50, workers=0, on_error="skip",
                         overwrite=True, progress=False)
    assert m["skipped_records"] == 1 and m["skipped_examples"][0].startswith(f"{p}:51:")
    assert sorted(f.name for f in out.glob("*.bin")) == sorted(s["file"] for sp in m["splits"].values()
                                                               for s in sp["shards"])
    last = out / m["splits"]["train"]["shards"][-1]["file"]
    last.write_bytes(last.read_bytes()[:-2])
    with pytest.raises(DGemmaError, match="the corpus folder is damaged"):
        W.TokenWindows(out, "train", 8)


def test_ordered_bounded_never_reads_far_ahead():
    """The reader is pulled only as results are consumed, so memory cannot grow with the corpus."""
    from concurrent.futures import ThreadPoolExecutor

    reads = []

    def jobs():
        for i in range(50):
            reads.append(i)
            yield i, f"tag{i}"

    with ThreadPoolExecutor(3) as pool:
        out = []
        for tag, result in C.ordered_bounded(lambda x: pool.submit(lambda y: y * y, x), jobs(), 4):
            out.append((tag, result))
            assert len(reads) - len(out) <= 4
    assert out == [(f"tag{i}", i * i) for i in range(50)]


# -- sampler ----------------------------------------------------------------------------------
def draw(sampler, batches, batch):
    return [sampler.next_batch(batch) for _ in range(batches)]


def test_sampler_determinism_and_resume():
    a, b = W.WindowSampler(10, seed=3), W.WindowSampler(10, seed=3)
    first = draw(a, 8, 3)  # 24 indices: crosses two epoch boundaries
    assert first == draw(b, 8, 3)
    assert draw(W.WindowSampler(10, seed=4), 8, 3) != first
    assert sorted(sum(first, [])[:10]) == list(range(10))  # an epoch is a permutation
    a = W.WindowSampler(10, seed=3)
    draw(a, 5, 3)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    resumed = W.WindowSampler(10, seed=3)
    resumed.load_state_dict(state)
    assert draw(resumed, 6, 3) == draw(a, 6, 3) == first[5:] + draw(W.WindowSampler(10, seed=3), 11, 3)[8:]
    with pytest.raises(DGemmaError, match="data set or seed changed"):
        W.WindowSampler(11, seed=3).load_state_dict(state)


def test_sampler_ranks_split_each_global_batch():
    world, batch = 3, 2
    ranks = [W.WindowSampler(50, seed=0, rank=r, world=world) for r in range(world)]
    single = W.WindowSampler(50, seed=0)
    for _ in range(20):  # 120 indices: several epochs
        parts = [s.next_batch(batch) for s in ranks]
        assert sum(parts, []) == single.next_batch(batch * world)
    ranks = [W.WindowSampler(60, seed=0, rank=r, world=world) for r in range(world)]
    seen = [sum(draw(s, 10, batch), []) for s in ranks]  # exactly one epoch of 60
    assert sorted(sum(seen, [])) == list(range(60))


# -- Lite batches -----------------------------------------------------------------------------
@pytest.fixture()
def small_corpus(tmp_path, bpe):
    rng = random.Random(3)
    write_jsonl(tmp_path / "a.jsonl", [sentence(rng) for _ in range(80)])
    C.prepare_corpus(tmp_path / "a.jsonl", tokenizer=bpe, out_dir=tmp_path / "out", shard_tokens=100, workers=0,
                     val_fraction=0.1, progress=False)
    return tmp_path / "out"


def test_corpus_batch_is_all_canvases(small_corpus):
    from dgemma.diffusion.objective import batch_info

    data = W.CorpusData(small_corpus, seq_len=32, canvas_size=8)
    assert len(data) == len(W.TokenWindows(small_corpus, "train", 32)) and data.num_canvases == 4
    assert data.eos_id == 1 and data.vocab_size == 300 and data.tokenizer_path.is_file()
    b = data.batch([2, 0, 5])
    assert b["prompt_ids"].shape == b["prompt_valid"].shape == (3, 0)
    assert b["canvas_ids"].shape == b["canvas_valid"].shape == (3, 32) and b["canvas_valid"].all()
    assert b["canvas_mask"].shape == (3, 4) and b["canvas_mask"].all()
    assert b["canvas_ids"][1].tolist() == data.windows[0].tolist()
    info = batch_info(b, 8)
    assert info.positions.tolist() == [list(range(32))] * 3
    assert info.blocks.tolist() == [[k // 8 + 1 for k in range(32)]] * 3
    assert info.valid.all() and not info.noisy.any()
    with pytest.raises(DGemmaError, match="multiple of canvas_size"):
        W.CorpusData(small_corpus, seq_len=30, canvas_size=8)


def test_corpus_batch_trains_a_tiny_lite_model(small_corpus):
    from dgemma.diffusion.corruption import UniformNoise
    from dgemma.diffusion.objective import DiffusionObjective
    from dgemma.diffusion.schedules import CosineSchedule
    from dgemma.models.transformer import DiffusionGemma, ModelConfig

    data = W.CorpusData(small_corpus, seq_len=32, canvas_size=8)
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                      layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                      encoder_mode="block", eos_token_id=1, pad_token_id=0)
    model = DiffusionGemma(cfg)
    objective = DiffusionObjective(noise=UniformNoise(300, CosineSchedule()), canvas_size=8, decode="all",
                                   ar_loss_weight=0.0, selfcond_prob=0.0)
    terms = objective(model, data.batch([0, 1]), torch.Generator().manual_seed(0))
    assert int(terms.diffusion_count) == 2 * 32 and torch.isfinite(terms.diffusion_sum)
    terms.objective(terms.diffusion_count, 1, 0.0).backward()


# -- CLI --------------------------------------------------------------------------------------
def test_cli_trains_bpe_and_matches_in_process(tmp_path, capsys):
    rng = random.Random(4)
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [sentence(rng) for _ in range(150)], field="body")
    write_jsonl(tmp_path / "in" / "b.jsonl", [sentence(rng) for _ in range(150)], field="body")
    out = tmp_path / "out"
    argv = ["prepare", "corpus", "--input", str(tmp_path / "in" / "*.jsonl"), "--out", str(out), "--vocab-size", "300",
            "--workers", "2", "--shard-tokens", "500", "--val-fraction", "0.1", "--text-field", "body"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = json.loads((out / "manifest.json").read_text())
    assert line.startswith("corpus: 300 documents, ")
    assert "uint16, vocab 300, tokenizer tokenizer/tokenizer.json" in line
    assert m["tokenizer"]["trained"] and m["requested_vocab_size"] == 300 and m["splits"]["val"]["documents"] == 30
    assert len(m["inputs"]) == 2 and len(m["splits"]["train"]["shards"]) > 1

    ref = C.prepare_corpus(tmp_path / "in", tokenizer=out / "tokenizer", out_dir=tmp_path / "ref", shard_tokens=500,
                           workers=0, val_fraction=0.1, text_field="body", progress=False)
    for split in ("train", "val"):  # two worker processes write exactly what one in-process pass writes
        assert stream(out, split, m).tolist() == stream(tmp_path / "ref", split, ref).tolist()

    assert main(["prepare", "corpus", "--input", str(tmp_path / "in"), "--out", str(out), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgemma prepare: error: ") and "already holds a prepared corpus" in err
    (tmp_path / "x.csv").write_text("a,b\n")
    assert main(["prepare", "corpus", "--input", str(tmp_path / "x.csv"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown extension '.csv'" in err
