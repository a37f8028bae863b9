"""Chat prompts, answer checks and a reward function named on the command line (``task.*``).

Prompt files may hold chat messages, rendered once with the model tokenizer's chat template
(``task.chat_template``, ``task.system_prompt``); completions are checked by their last number or
their last ``\\boxed{}`` (``task.reward``); ``task.reward_function`` loads a Python function from a
file and sends it to the reward workers. The tokenizer is the embedded character tokenizer with a
small chat template of its own (no hub downloads).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshrl.config import ConfigError, load_config
from meshrl.embedded.tokenizer import build_char_tokenizer
from meshrl.tasks import Problem, TaskConfig, build_task, load_reward_function
from meshrl.tasks.answers import answer_reward, extract_boxed, extract_last_number, parse_number

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer_dir(path: Path, *, adds_bos: bool = False) -> str:
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    if adds_bos:  # as Llama's tokenizers do: encoding puts BOS first, and the template writes it too
        from tokenizers.processors import TemplateProcessing

        tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    tok.save_pretrained(path)
    return str(path)


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _file_task(tmp_path: Path, records: list[dict], model: str | None, **cfg) -> object:
    data = _jsonl(tmp_path / "data.jsonl", records)
    return build_task(TaskConfig(kind="file", train_file=data, test_file=data, **cfg), model)


RECORDS = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}, {"prompt": "2+2=", "answer": 4}]


def test_chat_messages_are_rendered_and_strings_follow_task_chat_template(tmp_path):
    model = chat_tokenizer_dir(tmp_path / "tok")
    auto = _file_task(tmp_path, RECORDS, model).split("train")
    assert [p.prompt for p in auto] == ["<bos><user>1+1=\n<assistant>", "2+2="]  # null: messages only
    every = _file_task(tmp_path, RECORDS, model, chat_template=True, system_prompt="Add.").split("test")
    assert [p.prompt for p in every] == ["<bos><system>Add.\n<user>1+1=\n<assistant>",
                                         "<bos><system>Add.\n<user>2+2=\n<assistant>"]
    assert [p.answer for p in every] == ["2", "4"]
    with pytest.raises(ValueError, match=r"data.jsonl:1: field 'prompt' must be a non-blank string.*chat_template"):
        _file_task(tmp_path, RECORDS, model, chat_template=False)
    with pytest.raises(ValueError, match=r"data.jsonl:1: field 'prompt', message 0: expected"):
        _file_task(tmp_path, [{"prompt": [{"role": "user"}], "answer": "2"}], model)
    # the built-in task, rendered for an instruct model
    addition = build_task(TaskConfig(chat_template=True, digits=1, num_test=4), model)
    assert all(p.prompt.startswith("<bos><user>") and p.prompt.endswith("=\n<assistant>") for p in addition.split("test"))


def test_a_tokenizer_that_adds_bos_gets_no_second_one_from_the_template(tmp_path):
    model = chat_tokenizer_dir(tmp_path / "tok", adds_bos=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    (problem, _) = _file_task(tmp_path, RECORDS, model).split("train")
    ids = tok(problem.prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_chat_prompts_without_a_chat_template_fail_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"`task.chat_template`: the tokenizer of the embedded default"):
        build_task(TaskConfig(chat_template=True, digits=1, num_test=4), None)
    for template in (False, None):  # null: string prompts are used as they are, and would never see it
        with pytest.raises(ValueError, match="task.system_prompt needs task.chat_template=true"):
            TaskConfig(chat_template=template, system_prompt="Be brief.")
    with pytest.raises((ValueError, ConfigError), match="task.reward_function must be"):
        TaskConfig(reward_function="score.py")


@pytest.mark.parametrize("mode, answer, completion, correct, found", [
    ("last_number", "-50", "She lost -$50.", 1.0, 1.0),
    ("last_number", "1500", "that is 1.5e3", 1.0, 1.0),
    ("last_number", "1000", "1{,}000 in all", 1.0, 1.0),
    ("last_number", "10", "8-10 apples", 1.0, 1.0),  # a range, not -10
    ("last_number", "Half of 48 is <<48/2=24>>24.\n#### 72", "so 72", 1.0, 1.0),  # GSM8K's answer field
    ("boxed", "-1/2", "\\boxed{-\\dfrac{1}{2}}", 1.0, 1.0),
    ("boxed", "\\frac{1}{2}", "\\boxed{\\frac12}", 1.0, 1.0),
    ("boxed", "A", "\\boxed{\\text{(A)}}", 1.0, 1.0),
    ("boxed", "90", "\\boxed{90^\\circ}", 1.0, 1.0),
    ("boxed", "so \\boxed{7}.", "\\boxed{7}", 1.0, 1.0),  # a whole solution in the answer field
    ("last_number", "18", "She has 3 + 15 = 18 apples.\n#### 18", 1.0, 1.0),
    ("last_number", "1234", "The answer is $1,234.", 1.0, 1.0),
    ("last_number", "0.5", "half: 1/2 is .5", 1.0, 1.0),
    ("last_number", "18", "18 apples, then 3 more: 21", 0.0, 1.0),
    ("last_number", "7", "no idea", 0.0, 0.0),
    ("boxed", "\\frac{1}{2}", "so x = \\boxed{0.5}", 1.0, 1.0),
    ("boxed", "x^{2}+1", "\\boxed{x^{2} + 1}", 1.0, 1.0),
    ("boxed", "3", "\\boxed{2} no wait \\boxed{3}", 1.0, 1.0),
    ("boxed", "3", "\\boxed{3", 0.0, 0.0),  # cut off before the brace closed
    ("exact", "42", " 42\n", 1.0, None),
    ("exact", "42", "it is 42", 0.0, None),
])
def test_answer_checks(mode, answer, completion, correct, found):
    out = answer_reward(mode, Problem(id=0, prompt="q", answer=answer), completion)
    assert out.reward == correct == out.info["correct"]
    assert out.info.get("answer_found") == found


@given(st.integers(-10**9, 10**9), st.sampled_from(["{:,}", "{}", "${:,}", "{}.0"]), st.text(max_size=20))
def test_the_last_number_is_read_whatever_its_format(n, fmt, prefix):
    text = prefix + " so the answer is " + fmt.format(n).replace("$-", "-$")
    assert parse_number(extract_last_number(text)) == n


def test_boxed_braces_nest():
    assert extract_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}"
    assert extract_boxed("\\fbox{5}") == "5" and extract_boxed("nothing") is None


def test_reward_function_loads_from_a_file_and_says_what_is_wrong(tmp_path):
    (tmp_path / "score.py").write_text("def score(problem, completion):\n    return float(problem.answer in completion)\n")
    fn = load_reward_function(f"{tmp_path / 'score.py'}:score")
    assert fn(Problem(id=0, prompt="q", answer="4"), "it is 4") == 1.0
    assert load_reward_function("meshrl.tasks:exact_match_reward").__name__ == "exact_match_reward"
    with pytest.raises(ValueError, match="file not found"):
        load_reward_function(f"{tmp_path / 'nope.py'}:score")
    with pytest.raises(ValueError, match=r"has no function 'scor' \(it has \['score'\]\)"):
        load_reward_function(f"{tmp_path / 'score.py'}:scor")
    (tmp_path / "broken.py").write_text("def score(:\n")
    with pytest.raises(ValueError, match="importing .*broken.py failed: SyntaxError"):
        load_reward_function(f"{tmp_path / 'broken.py'}:score")


@pytest.mark.slow
def test_pipeline_trains_on_chat_prompts_with_a_reward_function_from_the_command_line(ray_cluster, tmp_path):
    import tiny
    from meshrl.pipeline import Pipeline, PipelineConfig

    model = tiny.model_dir(tmp_path / "model", layers=1)  # its own: it gets a chat template
    chat_tokenizer_dir(Path(model))
    records = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a in range(5) for b in range(5)]
    data = _jsonl(tmp_path / "train.jsonl", records)
    (tmp_path / "score.py").write_text(
        "from meshrl.tasks import RewardOutput\n"
        "def score(problem, completion):\n"
        "    assert problem.prompt.startswith('<bos><user>'), problem.prompt\n"
        "    return RewardOutput(reward=sum(c.isdigit() for c in completion) / max(1, len(completion)), info={'custom': 1.0})\n"
    )
    cfg = load_config(PipelineConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.total_steps=2", "run.eval_every=0",
        "run.progress=false", "task.kind=file", f"task.train_file={data}", f"task.test_file={data}",
        f"task.reward_function={tmp_path / 'score.py'}:score", "algo=grpo", "algo.samples_per_prompt=2",
        "trainer.samples_per_step=8", "rollout.prompts_per_request=2", "rollout.requests_in_flight=2",
        "rollout.max_new_tokens=3",
    ])
    summary = asyncio.run(Pipeline(cfg).run())
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert summary["steps"] == 2 and all(s["reward_info/custom"] == 1.0 for s in steps)
    assert all(s["reward_failed_frac"] == 0 for s in steps)  # the prompts it saw were rendered
    with pytest.raises(ConfigError, match="`task.reward_function`: Pipeline\\(reward=...\\) gives a reward too"):
        Pipeline(cfg, reward=lambda problem, completion: 0.0)


def test_build_task_checks_answers_as_task_reward_says(tmp_path):
    records = [{"prompt": "Natalia sold 48 clips...", "answer": "Half of 48 is 24.\n#### 72"}]
    task = _file_task(tmp_path, records, None, reward="last_number")
    (problem,) = task.split("train")
    assert task.reward(problem, "24 + 48 = 72").reward == 1.0 and task.reward(problem, "72.5").reward == 0.0
    addition = build_task(TaskConfig(digits=1, num_test=4, reward="last_number"))
    p = addition.split("test")[0]
    assert addition.reward(p, f"The sum is {p.answer}.").reward == 1.0
    assert build_task(TaskConfig(digits=1, num_test=4)).reward(p, f"The sum is {p.answer}.").reward == 0.0


def test_the_resume_check_compares_prompts_as_written_and_how_they_are_rendered(tmp_path):
    from meshrl.pipeline import PipelineConfig
    from meshrl.pipeline.checkpoint import RunState, check_fingerprint, run_fingerprint
    from meshrl.tasks import source_split

    data = _jsonl(tmp_path / "data.jsonl", RECORDS)
    dirs = []
    for day in ("01", "02"):  # a template that renders today's date (Llama 3's does)
        tok = build_char_tokenizer()
        tok.chat_template = "Today " + day + " Dec. " + TEMPLATE
        tok.save_pretrained(tmp_path / day)
        dirs.append(str(tmp_path / day))

    def config(model: str, *extra: str) -> PipelineConfig:
        return load_config(PipelineConfig, None, [f"model.path={model}", "task.kind=file", f"task.train_file={data}",
                                                  f"task.test_file={data}", *extra])

    first = build_task(config(dirs[0]).task, dirs[0])
    state = RunState(step=1, version=1, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                     in_flight=[], queue_snapshot=b"", fingerprint=run_fingerprint(config(dirs[0]), source_split(first, "train")))
    next_day = build_task(config(dirs[1]).task, dirs[1])
    assert first.split("train")[0].prompt != next_day.split("train")[0].prompt
    check_fingerprint(tmp_path, state, config(dirs[0]), source_split(next_day, "train"))  # the next day resumes
    check_fingerprint(tmp_path, state, config(dirs[0], "task.reward=last_number"), source_split(first, "train"))
    with pytest.raises(ConfigError, match="task"):
        check_fingerprint(tmp_path, state, config(dirs[0], "task.chat_template=true"), source_split(first, "train"))


def test_a_reward_file_may_use_dataclasses_and_import_its_neighbours(tmp_path):
    (tmp_path / "helpers.py").write_text("def digits(text):\n    return sum(c.isdigit() for c in text)\n")
    (tmp_path / "dc.py").write_text(
        "from __future__ import annotations\n"
        "import dataclasses, functools\n"
        "from helpers import digits\n"
        "@dataclasses.dataclass\n"
        "class Weights:\n    scale: float = 0.5\n"
        "@functools.lru_cache\n"
        "def weights() -> Weights:\n    return Weights()\n"
        "def score(problem, completion):\n    return weights().scale * digits(completion)\n"
    )
    fn = load_reward_function(f"{tmp_path / 'dc.py'}:score")
    assert fn(Problem(id=0, prompt="q", answer="1"), "a12") == 1.0
