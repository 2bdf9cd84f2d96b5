"""Chat and completion data: validation with file:line, skip/fail, records, truncation."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from dgemma.data.char_tokenizer import CharTokenizer
from dgemma.data.chat import (
    chat_to_records,
    chats_to_records,
    completion_to_record,
    conversation_problem,
    encode_prompt_text,
    is_jsonl_source,
    left_truncate,
    load_chat_records,
    load_completion_records,
    load_hf_chat,
    read_chat,
    render_prompt,
    read_chat_jsonl,
    read_completion_jsonl,
    skipped_summary,
    truncation_summary,
)
from dgemma.data.tokenizers import Tokenizer
from dgemma.errors import DGemmaError

SYS, U1, A1, U2, A2 = "Be brief.", "What is 2 + 2?", "  2 + 2 = 4. The answer is 4. ", "And 3 + 3?", "The answer is 6."
CONV = [{"role": "system", "content": SYS}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1},
        {"role": "user", "content": U2}, {"role": "assistant", "content": A2}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A byte-level BPE with Gemma's special tokens: the real Tokenizer, so render_chat is Gemma's."""
    from tests.conftest import tiny_bpe

    return tiny_bpe(["What is 2 + 2? The answer is 4.", "hello world"])


def write_lines(path, lines) -> str:
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return str(path)


def good(**extra) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                       **extra})


def msgs(*pairs) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in pairs]})


# -- validation -----------------------------------------------------------------------------------
BAD_LINES = [
    ('{"messages": [', "invalid JSON"),
    ("[1, 2]", "expected a JSON object with a 'messages' list, got a list"),
    ('{"conversation": []}', "no 'messages' field"),
    ('{"messages": "hi"}', "'messages' must be a list of messages, got a string"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"messages": ["hi"]}', "message 0 must be an object with 'role' and 'content', got a string"),
    ('{"messages": [{"content": "hi"}]}', "message 0 has no 'role'"),
    (msgs(("human", "hi"), ("assistant", "x")), "message 0 has role 'human'; expected one of system, user, assistant"),
    ('{"messages": [{"role": "user"}]}', "message 0 (user) has no 'content'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "message 0 (user) content must be a string, got a number"),
    (msgs(("user", "a"), ("system", "s"), ("assistant", "b")), "message 1 is a system message; only the first"),
    (msgs(("system", "s"), ("assistant", "b")), "no user turn"),
    (msgs(("user", "a"), ("user", "b"), ("assistant", "c")), "message 1 is 'user' where 'assistant' was expected"),
    (msgs(("user", "a"), ("assistant", "b"), ("user", "c")), "ends with a 'user' turn, not an assistant turn"),
    (msgs(("user", "a"), ("assistant", " \n ")), "message 1 is an empty assistant turn"),
    (msgs(("user", "a"), ("assistant", ""), ("user", "c"), ("assistant", "d")), "message 1 is an empty assistant turn"),
    (b'{"messages": "\xff"}', "not UTF-8 text"),
]


@pytest.mark.parametrize("line, what", BAD_LINES)
def test_each_bad_line_is_reported_with_file_and_line(tmp_path, line, what):
    path = write_lines(tmp_path / "chat.jsonl", [good(), "", line, good()])
    records, problems = read_chat_jsonl(path, on_error="skip")
    assert len(records) == 2 and len(problems) == 1
    assert problems[0].startswith(f"{path}:3: ") and what in problems[0], problems[0]
    with pytest.raises(DGemmaError, match="chat.jsonl:3: ") as e:
        read_chat_jsonl(path)  # on_error="fail" is the default
    assert what in str(e.value) and "on_error='skip'" in str(e.value)


def test_valid_file_keeps_extra_keys_and_source(tmp_path):
    path = write_lines(tmp_path / "ok.jsonl", [good(id="a"), "   ", good(id="b", meta=[1])])
    records, problems = read_chat_jsonl(path)
    assert problems == []
    assert [r["id"] for r in records] == ["a", "b"]
    assert [r["source"] for r in records] == [f"{path}:1", f"{path}:3"]  # blank line 2 is not a row
    assert records[1]["meta"] == [1]


def test_fail_names_first_problem_and_counts_the_rest(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [good(), "{", good(), '{"messages": []}', "[]"])
    with pytest.raises(DGemmaError) as e:
        read_chat_jsonl(path, on_error="fail")
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: invalid JSON") and "(and 2 more bad rows in" in msg
    assert "\n" not in msg


def test_skip_returns_every_problem_counts_and_logs(tmp_path, caplog):
    path = write_lines(tmp_path / "c.jsonl", [good(), "{", good(), '{"messages": []}', "[]", good()])
    with caplog.at_level(logging.WARNING, logger="dgemma.data.chat"):
        records, problems = read_chat_jsonl(path, on_error="skip")
    assert len(records) == 3
    assert [p.split(": ")[0] for p in problems] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert f"skipped 3 bad rows of 6 (on_error='skip'); first: {path}:2: invalid JSON" in caplog.text
    assert skipped_summary(problems, kept=3, source=path) in caplog.text
    assert skipped_summary([], kept=3, source="x") == "x: 3 rows, none skipped"


def test_bad_arguments_and_missing_file(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [good()])
    with pytest.raises(DGemmaError, match="on_error must be 'fail' or 'skip'"):
        read_chat_jsonl(path, on_error="ignore")
    with pytest.raises(DGemmaError, match="data file not found"):
        read_chat_jsonl(tmp_path / "nope.jsonl")


# -- records --------------------------------------------------------------------------------------
TURN1 = f"<start_of_turn>user\n{SYS}\n\n{U1}<end_of_turn>\n<start_of_turn>model\n"
TURN2 = TURN1 + f"{A1.strip()}<end_of_turn>\n<start_of_turn>user\n{U2}<end_of_turn>\n<start_of_turn>model\n"


def test_supervise_last_renders_the_whole_history(tok):
    [r] = chat_to_records({"messages": CONV, "id": "c1", "source": "f:7"}, tok)
    assert r == {"id": "c1", "source": "f:7", "prompt_text": TURN2, "history": CONV[:4], "prompt": U2,
                 "response": A2, "turn": 1, "system": SYS}


def test_supervise_all_gives_one_record_per_assistant_turn(tok):
    r0, r1 = chat_to_records(CONV, tok, supervise="all")
    assert (r0["prompt_text"], r0["response"], r0["prompt"], r0["turn"]) == (TURN1, A1.strip(), U1, 0)
    assert (r1["prompt_text"], r1["response"], r1["prompt"], r1["turn"]) == (TURN2, A2, U2, 1)
    assert r0["system"] == r1["system"] == SYS
    # the rendered history ends exactly where the template would write the supervised turn
    full = tok.render_chat(CONV, add_generation_prompt=False)
    assert full == r1["prompt_text"] + r1["response"] + "<end_of_turn>\n"


def test_records_without_tokenizer_render_the_same_prompt(tok):
    with_tok = chat_to_records(CONV, tok, supervise="all")
    without = chat_to_records(CONV, supervise="all")
    assert all("prompt_text" not in r for r in without)
    assert [render_prompt(tok, r) for r in without] == [r["prompt_text"] for r in with_tok] == [TURN1, TURN2]
    assert [{k: v for k, v in r.items() if k != "prompt_text"} for r in with_tok] == without


def test_render_prompt_precedence(tok):
    assert render_prompt(tok, {"prompt_text": "raw 2+2=", "prompt": "ignored"}) == "raw 2+2="
    assert render_prompt(tok, {"prompt": U1, "system": SYS}) == TURN1  # other tasks' records: chat_prompt
    with pytest.raises(DGemmaError, match="needs a tokenizer with a chat template"):
        render_prompt(CharTokenizer.named("digits"), {"history": CONV[:2]})
    with pytest.raises(DGemmaError, match="record 'q' has no prompt_text, history or string prompt"):
        render_prompt(tok, {"id": "q"})


def test_records_without_system_and_many_conversations(tok):
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    records = chats_to_records([conv, {"messages": CONV}], tok, supervise="all")
    assert len(records) == 3 and "system" not in records[0]
    assert records[0]["prompt_text"] == "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\n"
    assert len(chats_to_records([conv, {"messages": CONV}], tok)) == 2


def test_chat_to_records_refuses_bad_input(tok):
    with pytest.raises(DGemmaError, match="supervise must be"):
        chat_to_records(CONV, tok, supervise="first")
    with pytest.raises(DGemmaError, match="f.jsonl:4: the conversation ends with a 'user' turn"):
        chat_to_records({"messages": CONV[:4], "source": "f.jsonl:4"}, tok)
    with pytest.raises(DGemmaError, match="needs a tokenizer with a chat template"):
        chat_to_records(CONV, CharTokenizer.named("digits"))


def test_load_chat_records_end_to_end(tmp_path, tok):
    path = write_lines(tmp_path / "c.jsonl", [json.dumps({"messages": CONV}), "{oops", good()])
    records, problems = load_chat_records(path, tok, supervise="all", on_error="skip")
    assert len(records) == 3 and len(problems) == 1 and problems[0].startswith(f"{path}:2: ")
    assert records[0]["source"] == records[1]["source"] == f"{path}:1"


# -- completion -----------------------------------------------------------------------------------
def test_completion_rows(tmp_path):
    lines = [json.dumps({"prompt": "2+2=", "completion": "4", "id": 1}), '{"prompt": "x"}',
             '{"prompt": 1, "completion": "a"}', '{"prompt": "x", "completion": "  "}', "not json",
             json.dumps({"prompt": "", "completion": "free text"})]
    path = write_lines(tmp_path / "comp.jsonl", lines)
    rows, problems = read_completion_jsonl(path, on_error="skip")
    assert problems == [f"{path}:2: no 'completion' field", f"{path}:3: 'prompt' must be a string, got a number",
                        f"{path}:4: empty completion", f"{path}:5: invalid JSON (Expecting value at column 1)"]
    assert len(rows) == 2
    assert completion_to_record(rows[0]) == {"id": 1, "source": f"{path}:1", "prompt_text": "2+2=",
                                             "prompt": "2+2=", "response": "4"}
    with pytest.raises(DGemmaError, match=r"comp.jsonl:2: no 'completion' field \(and 3 more bad rows"):
        read_completion_jsonl(path)
    records, _ = load_completion_records(path, on_error="skip")
    assert [r["prompt_text"] for r in records] == ["2+2=", ""]  # raw, no chat markup
    with pytest.raises(DGemmaError, match="invalid completion row: no 'prompt' field"):
        completion_to_record({"completion": "x"})


# -- truncation -----------------------------------------------------------------------------------
def test_left_truncate():
    assert left_truncate([2, 5, 6, 7, 8], 3) == ([2, 7, 8], True)
    assert left_truncate([2, 5, 6, 7, 8], 3, keep_first=False) == ([6, 7, 8], True)
    assert left_truncate([2, 5, 6], 3) == ([2, 5, 6], False)
    assert left_truncate((2, 5), 1) == ([2], True)
    with pytest.raises(DGemmaError, match="prompt_len must be >= 1"):
        left_truncate([1], 0)


def test_encode_prompt_text_keeps_bos_and_the_end(tok):
    [r] = chat_to_records(CONV, tok)
    full = tok.encode(r["prompt_text"], add_bos=True)
    ids, cut = encode_prompt_text(tok, r["prompt_text"], 10)
    assert cut and len(ids) == 10 and ids[0] == tok.bos_id and ids[1:] == full[-9:]
    ids, cut = encode_prompt_text(tok, r["prompt_text"], len(full))
    assert not cut and ids == full


def test_truncation_summary_counts():
    assert truncation_summary([True, False, True, False, False], prompt_len=8) == (
        2, "2 of 5 prompts (40.0%) were longer than prompt_len=8 and were truncated from the left")
    assert truncation_summary([False] * 3, prompt_len=8) == (0, "no prompt of 3 was longer than prompt_len=8")


# -- Hugging Face datasets ------------------------------------------------------------------------
def test_load_hf_chat_without_datasets_says_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DGemmaError, match="pip install datasets") as e:
        load_hf_chat("someone/chats", "train")
    assert "\n" not in str(e.value)
    with pytest.raises(DGemmaError, match="pip install datasets"):
        read_chat("someone/chats")  # not a JSONL path: goes to the Hugging Face loader


def fake_datasets(monkeypatch, load_dataset):
    mod = types.ModuleType("datasets")
    mod.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", mod)


def test_load_hf_chat_validates_rows(monkeypatch):
    rows = [json.loads(good()), {"messages": []}, json.loads(good(id="z"))]
    calls = []
    fake_datasets(monkeypatch, lambda name, split: calls.append((name, split)) or rows)
    records, problems = load_hf_chat("org/set", "test", on_error="skip")
    assert calls == [("org/set", "test")]
    assert problems == ["org/set[test] row 1: 'messages' is empty"]
    assert [r["source"] for r in records] == ["org/set[test] row 0", "org/set[test] row 2"]
    with pytest.raises(DGemmaError, match=r"^org/set\[test\] row 1: 'messages' is empty; fix the data"):
        load_hf_chat("org/set", "test")


def test_load_hf_chat_load_failure_is_one_line(monkeypatch):
    def unreachable(name, split):
        raise ConnectionError("Couldn't reach 'org/set' on the Hub (LocalEntryNotFoundError)\nmore detail")

    fake_datasets(monkeypatch, unreachable)
    with pytest.raises(DGemmaError) as e:
        load_hf_chat("org/set", "train")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot load Hugging Face dataset org/set[train]: ConnectionError: ")
    assert "network access" in msg and "more detail" not in msg


def test_jsonl_sources(tmp_path):
    assert is_jsonl_source(tmp_path / "missing.jsonl") and not is_jsonl_source("org/set")
    path = write_lines(tmp_path / "data.txt", [good()])
    assert is_jsonl_source(path)
    assert len(read_chat(path)[0]) == 1
    with pytest.raises(DGemmaError, match="data file not found"):
        read_chat(tmp_path / "typo.jsonl")  # a mistyped file is not sent to the Hub


def test_conversation_problem_accepts_minimal_and_system_conversations():
    assert conversation_problem({"messages": [{"role": "user", "content": ""},
                                              {"role": "assistant", "content": "x"}]}) is None
    assert conversation_problem({"messages": CONV}) is None


def test_response_end_appends_end_of_turn_or_eos(tok):
    import torch

    from dgemma.data.sft import SFTData, encode_example, response_end_id

    rec = {"id": "r", "prompt": "What is 2 + 2?", "response": "The answer is 4."}
    body = tok.encode(rec["response"])
    kw = dict(prompt_len=32, num_canvases=2, canvas_size=16)
    for end, end_id in (("end_of_turn", tok.end_of_turn_id), ("eos", tok.eos_id)):
        assert response_end_id(tok, end) == end_id
        canvases = encode_example(tok, rec, response_end=end, **kw).canvases
        flat = canvases.tokens.tolist()
        assert flat[: len(body) + 1] == body + [end_id]
    assert tok.end_of_turn_id != tok.eos_id
    default = SFTData(None, tok, records=[rec], **kw).examples[0].canvases.tokens
    assert torch.equal(default, encode_example(tok, rec, **kw).canvases.tokens)
    eos = SFTData(None, tok, records=[rec], response_end="eos", **kw).examples[0].canvases.tokens
    assert torch.equal(eos, encode_example(tok, rec, response_end="eos", **kw).canvases.tokens)
    assert not torch.equal(default, eos)
    with pytest.raises(DGemmaError, match="response_end must be"):
        response_end_id(tok, "eot")
    with pytest.raises(DGemmaError, match="no <end_of_turn>"):
        response_end_id(types.SimpleNamespace(eos_id=1, end_of_turn_id=None), "end_of_turn")
