"""File tasks read every record as written: JSON Lines split at newlines only, and fields that
cannot be a prompt or an answer fail at load time, naming the record, instead of becoming text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrl.tasks import FileTask, load_problems


def test_jsonl_records_may_contain_unicode_line_separators(tmp_path):
    path = tmp_path / "train.jsonl"
    prompts = ["first\u2028line", "para\u2029graph", "next\x85line", "tab\x0bs\x0cand\x1cseparators"]
    # ensure_ascii=False writes these characters raw, which JSON allows inside strings
    path.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}, ensure_ascii=False) + "\r\n"
                            for i, p in enumerate(prompts)), encoding="utf-8")
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
                          ({"prompt": "2+2=", "answer": True}, "answer")):
        path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(ValueError, match=f"t.jsonl:2: field '{field}' must be"):
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


def test_parquet_float32_and_decimal_answers_read_as_they_were_written(tmp_path):
    """pyarrow gives a float32 0.1 back as 0.10000000149011612, and a decimal column as Decimal: the
    first never matched a correct "0.1", the second was refused as "not a number"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import decimal

    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": pa.array([0.1, 3.7, 2.0], type=pa.float32())}),
                   tmp_path / "f32.parquet")
    assert [p.answer for p in load_problems(tmp_path / "f32.parquet")] == ["0.1", "3.7", "2"]
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array(np.array([0.5, 2.25], dtype=np.float16))}), tmp_path / "f16.parquet")
    assert [p.answer for p in load_problems(tmp_path / "f16.parquet")] == ["0.5", "2.25"]
    answers = pa.array([decimal.Decimal("3.50"), decimal.Decimal("100.00")], type=pa.decimal128(6, 2))
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": answers}), tmp_path / "dec.parquet")
    assert [p.answer for p in load_problems(tmp_path / "dec.parquet")] == ["3.5", "100"]


def test_blank_answers_other_encodings_and_folders_are_refused_naming_the_line(tmp_path):
    """A blank answer made an empty completion score 1.0; a UTF-16 file (PowerShell's >) failed with a
    bare codec error naming no file; a folder read as "file not found"; errors counted records, not
    lines."""
    path = tmp_path / "t.jsonl"
    path.write_text('\n\n{"prompt": "2+2=", "answer": "  "}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:3: field 'answer' is blank"):
        load_problems(path)
    path.write_text('{"prompt": "  ", "answer": "4"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: field 'prompt' must be a non-blank string"):
        load_problems(path)
    path.write_text('{"prompt": "2+2=", "answer": "4"}\n', encoding="utf-16")
    with pytest.raises(ValueError, match=r"t.jsonl: not UTF-8 text .* save it as UTF-8"):
        load_problems(path)
    with pytest.raises(ValueError, match="is a directory: name one .jsonl or .parquet file"):
        load_problems(tmp_path)
