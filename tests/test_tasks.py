"""The embedded default's tokenizer and tasks: built in code, saved and loaded like hub artefacts."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from meshrl.embedded import build_char_tokenizer
from meshrl.tasks import AdditionTask, FileTask, Problem, PromptStream, TaskConfig, build_task, exact_match_reward


def test_char_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tok = build_char_tokenizer()
    ids = tok.encode("37+45=82")
    assert len(ids) == 8 and tok.decode(ids) == "37+45=82"
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("37+45=82") == ids
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert loaded.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "37+45=82"


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_char_tokenizer_keeps_whitespace_when_auto_loaded_from_a_model_folder(tmp_path, model_type):
    """transformers 5 loads a Qwen2 folder's tokenizer as Qwen2Tokenizer, with its own byte-level
    pre-tokenizer: the plain " " and "\\n" tokens were never produced, so "What is 2 + 3?" came back
    as "Whatis2+3?" (prompts, observations and chat templates lost their whitespace)."""
    from transformers import AutoConfig

    tok = build_char_tokenizer()
    text = "What is 2 + 3?\n\tanswer: 5 ~{}|"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(text) == ids and loaded.decode(ids) == text


def test_char_tokenizer_restricted_to_given_characters(tmp_path):
    """``characters`` spells a small vocabulary: the four specials, then these characters in order;
    anything else is <unk>, and the folder round-trips through AutoTokenizer."""
    tok = build_char_tokenizer(characters="0123456789+=")
    assert len(tok) == 16
    ids = tok.encode("37+45=82")
    assert tok.decode(ids) == "37+45=82" and max(ids) == 15 and min(ids) >= 4
    assert tok.encode("7x") == [tok.convert_tokens_to_ids("7"), tok.unk_token_id]
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("37+45=82") == ids
    with pytest.raises(ValueError, match="at least one character"):
        build_char_tokenizer(characters="")


def test_addition_splits_are_disjoint_and_answers_are_right():
    task = AdditionTask(digits=2, num_test=300, seed=3)
    train, test = task.split("train"), task.split("test")
    assert len(test) == 300 and len(train) == 10_000 - 300
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    for p in list(test[:20]) + list(train[:20]):
        a, b = p.prompt.rstrip("=").split("+")
        assert int(p.answer) == int(a) + int(b)
    assert AdditionTask(digits=2, num_test=300, seed=3).split("test") == test  # same seed, same split


def test_exact_match_reward():
    p = Problem(id=0, prompt="2+2=", answer="4")
    assert exact_match_reward(p, " 4\n").reward == 1.0
    assert exact_match_reward(p, "44").reward == 0.0
    assert exact_match_reward(p, "4").info == {"correct": 1.0}


def test_prompt_stream_is_seeded_and_resumes_exactly():
    problems = AdditionTask(digits=1, num_test=10).split("train")
    a = PromptStream(problems, seed=1)
    first = a.take(7) + a.take(200)  # crosses epoch boundaries
    b = PromptStream(problems, seed=1, position=7)
    assert b.take(200) == first[7:]
    assert [p.id for p in first[:len(problems)]] != list(range(len(problems)))  # shuffled
    assert sorted(p.id for p in first[: len(problems)]) == list(range(len(problems)))  # each once per epoch


def test_file_task_reads_jsonl_and_reports_bad_records(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps({"q": f"{i}*2=", "a": str(2 * i)}) for i in range(5)) + "\n")
    test.write_text(json.dumps({"q": "9*2=", "a": "18"}) + "\n")
    task = build_task(TaskConfig(kind="file", train_file=str(train), test_file=str(test), prompt_key="q", answer_key="a"))
    assert [p.prompt for p in task.split("train")][:2] == ["0*2=", "1*2="]
    assert task.reward(task.split("test")[0], "18").reward == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "1"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: the record has no field 'a' \(it has \['q'\]\)"):
        FileTask(bad, test, prompt_key="q", answer_key="a")
    (tmp_path / "x.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        FileTask(tmp_path / "x.csv", test)
    bad.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: the record is not an object"):
        FileTask(bad, test)


def test_file_task_reads_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    task = FileTask(path, path)
    assert [(p.prompt, p.answer) for p in task.split("test")] == [("1+1=", "2"), ("2+2=", "4")]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file"):
        FileTask(broken, path)
