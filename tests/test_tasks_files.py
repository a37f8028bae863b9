"""File tasks read every record as written: JSON Lines split at newlines only, and fields that
cannot be a prompt or an answer fail at load time, naming the record, instead of becoming text."""

from __future__ import annotations

import json

import pytest

from meshrl.tasks import FileTask, load_problems


def test_jsonl_records_may_contain_unicode_line_separators(tmp_path):
    path = tmp_path / "train.jsonl"
    prompts = ["first\u2028line", "para\u2029graph", "next\x85line", "tab\x0bs\x0cand\x1cseparators"]
    # ensure_ascii=False writes these characters raw, which JSON allows inside strings
    path.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}, ensure_ascii=False) + "\r\n"
                            for i, p in enumerate(prompts)), encoding="utf-8")  # fmt: skip
    problems = load_problems(path)
    assert [(p.id, p.prompt, p.answer) for p in problems] == [(i, p, str(i)) for i, p in enumerate(prompts)]


def test_fields_that_are_not_a_prompt_or_an_answer_fail_clearly(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "answer": 4}) + "\n" + json.dumps({"prompt": "1.5*2=", "answer": 3.5}) + "\n")
    assert [p.answer for p in load_problems(path)] == ["4", "3.5"]  # numbers are fine

    for record, field in (({"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}, "prompt"),
                          ({"prompt": "", "answer": "4"}, "prompt"),
                          ({"prompt": "2+2=", "answer": None}, "answer"),
                          ({"prompt": "2+2=", "answer": ["4", "four"]}, "answer"),
                          ({"prompt": "2+2=", "answer": True}, "answer")):  # fmt: skip
        path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(ValueError, match=f"t.jsonl: record 1: field '{field}' must be"):
            FileTask(path, path)


def test_whole_number_answers_read_as_floats_are_written_without_a_decimal_point(tmp_path):
    """A float column (Parquet, or JSON's 4.0) gave the answer "4.0", so a correct "4" scored 0."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["2+2=", "7/2=", "big"], "answer": [4.0, 3.5, 1e20]}), path)
    assert [p.answer for p in load_problems(path)] == ["4", "3.5", "100000000000000000000"]
    jsonl = tmp_path / "f.jsonl"
    jsonl.write_text(json.dumps({"prompt": "2+2=", "answer": 4.0}) + "\n")
    problem = load_problems(jsonl)[0]
    assert problem.answer == "4" and FileTask(jsonl, jsonl).reward(problem, "4").reward == 1.0


def test_a_byte_order_mark_and_an_upper_case_suffix_are_fine(tmp_path):
    path = tmp_path / "TRAIN.JSONL"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "1+1=", "answer": "2"}\n')
    assert [(p.prompt, p.answer) for p in load_problems(path)] == [("1+1=", "2")]
