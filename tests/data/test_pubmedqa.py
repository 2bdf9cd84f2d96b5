import json
from pathlib import Path

import pytest
import torch

from dgemma.cli.main import main
from dgemma.tasks import pubmedqa as P
from dgemma.errors import DGemmaError

REAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "pubmedqa"
needs_real = pytest.mark.skipif(not (REAL / P.ITEMS_FILE).is_file(), reason="PubMedQA files not present")


def _item(q="Q?", contexts=("c1", "c2"), long_answer="Because.", decision="yes"):
    return {"QUESTION": q, "CONTEXTS": list(contexts), "LONG_ANSWER": long_answer, "final_decision": decision}


def _source(tmp_path, items, test):
    d = tmp_path / "src"
    d.mkdir(exist_ok=True)
    (d / P.ITEMS_FILE).write_text(json.dumps(items))
    (d / P.TEST_FILE).write_text(json.dumps(test))
    return d


@pytest.fixture(scope="module")
def real():
    return P.load(REAL)


@needs_real
def test_real_split_sizes_and_labels(real):
    items, test = real
    splits = P.split_ids(items, test)
    assert {k: len(v) for k, v in splits.items()} == {"train": 450, "train_eval": 50, "test": 500}
    assert set(splits["test"]) == set(test)
    rest = [k for k in items if k not in test]
    assert splits["train_eval"] == rest[:50] and splits["train"] == rest[50:]
    labels = [items[k]["final_decision"] for k in splits["test"]]
    assert (labels.count("yes"), labels.count("no"), labels.count("maybe")) == (276, 169, 55)


@needs_real
def test_real_record_format(real):
    items, _ = real
    pmid = next(iter(items))
    it = items[pmid]
    r = P.make_record(pmid, it)
    assert set(r) == {"id", "system", "prompt", "response", "label", "long_answer", "verdict"}
    assert r["verdict"] == "last" and r["system"] == P.SYSTEM_PROMPT
    assert r["prompt"] == "Context:\n" + "\n".join(it["CONTEXTS"]) + "\n\nQuestion: " + it["QUESTION"]
    assert r["response"] == it["LONG_ANSWER"] + " The answer is: " + it["final_decision"]
    assert r["label"] == it["final_decision"] and r["long_answer"] == it["LONG_ANSWER"]
    assert '"The answer is: "' in r["system"]


def test_context_cap():
    prompt = P.format_prompt(["a" * 3000, "b" * 3000], "Why?")
    assert prompt == "Context:\n" + "a" * 3000 + "\n" + "b" * 999 + "\n\nQuestion: Why?"
    assert P.format_target("Long.", "maybe") == "Long. The answer is: maybe"
    with pytest.raises(DGemmaError, match="yes, no or maybe"):
        P.format_target("Long.", "Yes")


def test_write_splits_small(tmp_path):
    items = {str(i): _item(decision=("yes", "no", "maybe")[i % 3]) for i in range(60)}
    test = {"3": "yes", "7": "no"}
    items["3"]["final_decision"], items["7"]["final_decision"] = "yes", "no"
    meta = P.write_splits(_source(tmp_path, items, test), tmp_path / "out")
    assert meta["counts"] == {"train": 8, "train_eval": 50, "test": 2}
    out = tmp_path / "out"
    rows = {n: [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()] for n in meta["counts"]}
    assert [r["id"] for r in rows["test"]] == ["3", "7"]
    assert rows["train_eval"][0]["id"] == "0" and rows["train"][0]["id"] == "52"
    assert json.loads((out / "meta.json").read_text())["label_counts"]["test"] == {"yes": 1, "no": 1, "maybe": 0}


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(DGemmaError, match="source directory not found"):
        P.load(tmp_path / "nope")
    (tmp_path / P.ITEMS_FILE).write_text("{}")
    with pytest.raises(DGemmaError, match=f"file not found: .*{P.TEST_FILE}"):
        P.load(tmp_path)


def test_broken_json_reports_position(tmp_path):
    d = _source(tmp_path, {"1": _item()}, {})
    (d / P.ITEMS_FILE).write_text('{"1": {"QUESTION": "x",\n  "CONTEXTS": [}}')
    with pytest.raises(DGemmaError, match=r"ori_pqal.json: not valid JSON: .* at line 2, column 16 \(char 39\)"):
        P.load(d)


@pytest.mark.parametrize("field", ["QUESTION", "CONTEXTS", "LONG_ANSWER", "final_decision"])
def test_missing_field_names_item_and_field(tmp_path, field):
    bad = _item()
    del bad[field]
    d = _source(tmp_path, {"1": _item(), "12345": bad}, {})
    with pytest.raises(DGemmaError, match=f"item 12345 has no field '{field}'"):
        P.load(d)


def test_bad_values(tmp_path):
    with pytest.raises(DGemmaError, match="item 9: final_decision must be yes, no or maybe, got 'perhaps'"):
        P.load(_source(tmp_path, {"9": _item(decision="perhaps")}, {}))
    with pytest.raises(DGemmaError, match="item 9: field 'CONTEXTS' should be a list"):
        P.load(_source(tmp_path, {"9": {**_item(), "CONTEXTS": "text"}}, {}))
    with pytest.raises(DGemmaError, match="2 test ids are not in ori_pqal.json: 5, 6"):
        P.load(_source(tmp_path, {"1": _item()}, {"1": "yes", "5": "no", "6": "yes"}))
    with pytest.raises(DGemmaError, match="test id 1 is labelled 'no' but ori_pqal.json says 'yes'"):
        P.load(_source(tmp_path, {"1": _item()}, {"1": "no"}))
    with pytest.raises(DGemmaError, match="expected an object mapping"):
        P.load(_source(tmp_path, [1, 2], {}))


@needs_real
def test_cli_prepare_pubmedqa(tmp_path, capsys):
    out = tmp_path / "pq"
    assert main(["prepare", "pubmedqa", "--source", str(REAL), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"pubmedqa: 450 train, 50 train_eval, 500 test, verdict last -> {out}"
    for name, n in (("train", 450), ("train_eval", 50), ("test", 500)):
        assert len((out / f"{name}.jsonl").read_text().splitlines()) == n
    meta = json.loads((out / "meta.json").read_text())
    assert meta["label_counts"]["test"] == {"yes": 276, "no": 169, "maybe": 55}
    assert main(["prepare", "pubmedqa", "--source", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "source directory not found" in capsys.readouterr().err


def test_verdict_first_target_record_and_prepare(tmp_path, capsys):
    assert P.format_target("Long.", "no", "first") == "The answer is: no. Long."
    with pytest.raises(DGemmaError, match="'last' or 'first'"):
        P.format_target("Long.", "no", "middle")
    items = {str(i): _item(decision=("yes", "no", "maybe")[i % 3]) for i in range(60)}
    test = {"3": "yes"}
    out = tmp_path / "first"
    assert main(["prepare", "pubmedqa", "--source", str(_source(tmp_path, items, test)), "--out", str(out),
                 "--verdict", "first"]) == 0
    assert capsys.readouterr().out.strip() == f"pubmedqa: 9 train, 50 train_eval, 1 test, verdict first -> {out}"
    r = json.loads((out / "test.jsonl").read_text())
    assert r["response"] == "The answer is: yes. Because." and r["verdict"] == "first"
    assert r["system"] == P.SYSTEM_PROMPT_FIRST and "Begin with" in r["system"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["verdict"] == "first" and meta["system"] == P.SYSTEM_PROMPT_FIRST
    with pytest.raises(SystemExit) as e:
        main(["prepare", "pubmedqa", "--source", str(REAL), "--out", str(out), "--verdict", "x"])
    assert e.value.code == 2 and "invalid choice: 'x'" in capsys.readouterr().err


def test_bleu_reads_the_explanation_on_either_side_of_the_verdict():
    ref = "Statins lower the risk of stroke in older adults with diabetes."
    first, last = f"The answer is: yes. {ref}", f"{ref} The answer is: yes"
    assert P._bleu_hypothesis(first, "first") == ref and P._bleu_hypothesis(last, "last") == ref
    assert P._bleu_hypothesis("The answer is: maybe", "first") == ""
    assert P._bleu_hypothesis(ref, "first") == ref  # no verdict sentence: the whole text
    m_first = P.pubmedqa_metrics([first], ["yes"], [ref], ["first"])
    m_last = P.pubmedqa_metrics([last], ["yes"], [ref])
    assert m_first["accuracy"] == m_last["accuracy"] == 1.0
    assert m_first["bleu"] == pytest.approx(100.0) and m_last["bleu"] == pytest.approx(100.0)
    # a verdict-first output scored as verdict-last has no explanation before the marker
    assert P.pubmedqa_metrics([first], ["yes"], [ref], ["last"])["bleu"] < 1.0
    task = P.PubMedQATask()
    rec = {"label": "yes", "long_answer": ref, "verdict": "first"}
    assert task.score([first], [rec])["bleu"] == pytest.approx(100.0)
    assert task.score_one(first, rec)["bleu"] == pytest.approx(100.0)
    with pytest.raises(DGemmaError, match="verdict positions"):
        P.pubmedqa_metrics([first], ["yes"], [ref], [])


def test_key_tokens_are_the_verdict_and_weight_the_batch():
    """``diffusion.key_token_weight`` weighs the verdict's tokens (first or last occurrence, as the
    target puts it) and nothing else; a task without key tokens refuses the setting."""
    from dgemma.data.sft import SFTData
    from dgemma.tasks import get_task
    from dgemma.training.config import Config, DataConfig, DiffusionConfig
    from tests.conftest import tiny_bpe

    first = P.make_record("1", _item(long_answer="It is no trick, yes.", decision="no"), "first")
    last = P.make_record("2", _item(long_answer="It is no trick, yes.", decision="yes"), "last")
    tok = tiny_bpe([first["response"], last["response"], " maybe"])
    cfg = Config(diffusion=DiffusionConfig(key_token_weight=9.0, canvas_size=16, num_canvases=4),
                 data=DataConfig(task="pubmedqa", prompt_len=64))
    task = get_task("pubmedqa")
    fn = task.key_tokens(cfg, tok)
    for rec, word, which in ((first, " no", 0), (last, " yes", -1)):
        ids = tok.encode(rec["response"])
        keys = fn(rec, ids)
        assert tok.decode(ids[keys[0]:keys[-1] + 1]) == word
        starts = [i for i in range(len(ids)) if tok.decode(ids[i:i + len(keys)]) == word]
        assert keys[0] == starts[which] and len(starts) == 2  # the verdict, not the other mention
    data = SFTData(None, tok, records=[first, last], prompt_len=64, num_canvases=4, canvas_size=16,
                   **task.key_args(cfg, tok))
    w = data.batch([0, 1])["canvas_weight"]
    assert w.shape == (2, 64) and w.dtype == torch.float32
    for row, rec in enumerate((first, last)):
        keys = fn(rec, tok.encode(rec["response"]))
        assert w[row, keys].eq(9.0).all() and int((w[row] != 1.0).sum()) == len(keys)
    assert "canvas_weight" not in SFTData(None, tok, records=[first], prompt_len=64, num_canvases=4,
                                          canvas_size=16).batch([0])
    bad = {**first, "response": "The answer is: unsure."}
    with pytest.raises(DGemmaError, match="does not contain its verdict 'no'"):
        fn(bad, tok.encode(bad["response"]))
    with pytest.raises(DGemmaError, match="task 'sudoku' names no key tokens"):
        get_task("sudoku").key_args(Config(diffusion=DiffusionConfig(key_token_weight=2.0)), tok)
    from dgemma.training.trainer import build_train_data
    with pytest.raises(DGemmaError, match="task 'sudoku' names no key tokens"):  # its stream never reads it
        build_train_data(Config(diffusion=DiffusionConfig(key_token_weight=2.0)), tok)
    with pytest.raises(ValueError, match="key_token_weight must be positive"):
        DiffusionConfig(key_token_weight=0.0)
