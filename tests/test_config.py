"""Config loading: defaults, YAML, dotted overrides, presets, and one-line errors naming the key."""

from __future__ import annotations

import pytest

from meshrl.config import ConfigError, load_config, to_yaml
from meshrl.pipeline import PipelineConfig


def test_defaults_yaml_and_overrides_compose(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("queue:\n  max_staleness: 3\ntrainer:\n  lr: 2.0e-4\n")
    cfg = load_config(PipelineConfig, path, ["queue.max_staleness=5", "rollout.temperature=0.7"])
    assert cfg.queue.max_staleness == 5  # the override wins over the file
    assert cfg.trainer.lr == pytest.approx(2e-4)  # the file wins over the default
    assert cfg.rollout.temperature == pytest.approx(0.7)
    assert cfg.trainer.samples_per_step == PipelineConfig().trainer.samples_per_step  # untouched default


def test_preset_selects_algorithm_and_later_overrides_apply():
    cfg = load_config(PipelineConfig, None, ["algo=grpo", "algo.samples_per_prompt=8"])
    assert cfg.algo.advantage == "grpo" and cfg.algo.samples_per_prompt == 8
    assert not cfg.algo.uses_critic


def test_a_preset_replaces_the_other_presets_keys_and_keeps_the_rest(tmp_path):
    """`--config run.yaml algo=grpo` reset every algo key to its default: the file's kl_coef=0.05
    became 0 and the KL term was gone. A preset now sets only the keys presets set (so one preset
    still replaces another whole); the others keep the file's values."""
    (tmp_path / "run.yaml").write_text("algo:\n  advantage: gae\n  kl_coef: 0.05\n  entropy_coef: 0.01\n")
    cfg = load_config(PipelineConfig, tmp_path / "run.yaml", ["algo=grpo"])
    assert (cfg.algo.advantage, cfg.algo.samples_per_prompt, cfg.algo.clip_high) == ("grpo", 4, 0.28)
    assert cfg.algo.kl_coef == 0.05 and cfg.algo.entropy_coef == 0.01
    after_dr = load_config(PipelineConfig, None, ["algo=dr_grpo", "algo=grpo"])
    assert after_dr.algo == load_config(PipelineConfig, None, ["algo=grpo"]).algo  # not a mix of the two


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(PipelineConfig, None, ["algo=grpo", "queue.max_staleness=2", "model.path=/x"])
    (tmp_path / "c.yaml").write_text(to_yaml(cfg))
    assert load_config(PipelineConfig, tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["queue.max_stalenes=2"], "unknown config key `queue.max_stalenes`"),
        (["queue.max_staleness=abc"], "`queue.max_staleness`: Expected `int`, got `str`"),
        (["nonsense"], "not of the form key=value"),
        (["algo=nope"], "no such preset"),
        (["queue..x=1"], "malformed config key"),
        (["algo.advantage=grpo"], "samples_per_prompt >= 2"),
        (["rollout.temperature=1e-9"], "rollout.temperature must be 0 (greedy) or >= 1e-06"),
        (["rollout.top_p=0"], "rollout.top_p must be in (0, 1]"),
        (["rollout.top_k=0"], "rollout.top_k must be -1 (off) or >= 1"),
        (["trainer.lr=-0.1"], "trainer.lr must be a finite number >= 0"),
        (["trainer.warmup_steps=-1"], "trainer.warmup_steps must be >= 0"),
        (["trainer.min_lr_ratio=5"], "trainer.min_lr_ratio must be in [0, 1]"),
        (["algo.clip_low=-1"], "algo.clip_low must be in (0, 1)"),
        (["algo.gamma=-1"], "algo.gamma must be in [0, 1]"),
        (["rollout.engine.max_seq_len=-1"], "max_seq_len and kv_cache_bytes must be >= 0"),
        (["task.num_test=0"], "task.num_test must be >= 1"),
        (["warmstart.max_steps=0"], "warmstart.max_steps must be >= 1"),
        (["warmstart.check_every=0"], "warmstart.check_every must be >= 1"),
        (["queue.get_timeout_s=.inf"], "get_timeout_s must be a finite number of seconds"),
        # YAML 1.1 reads these as 256 and 90: nobody means that in a config
        (["trainer.samples_per_step=0400"], "`trainer.samples_per_step`: cannot parse value '0400': 0400 is a YAML 1.1 "
                                            "octal number (256): write 400, or quote it for a string"),
        (["run.total_steps=1:30"], "1:30 is a YAML 1.1 base-60 number (90)"),
        # accepted, then failing (or meaning something else) deep in the run
        (["algo.kl_coef=.nan"], "algo.kl_coef must be a finite number >= 0, got nan"),
        (["algo.entropy_coef=.inf"], "algo.entropy_coef must be a finite number >= 0"),
        (["trainer.weight_decay=.nan"], "trainer.weight_decay must be a finite number >= 0"),
        (["reshard.timeout_s=.inf"], "timeout_s a finite number of seconds > 0"),
        (["rollout.engine.generate_timeout_s=0"], "generate_timeout_s must be > 0 seconds"),
    ],
)
def test_bad_input_fails_with_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_in_yaml_is_named_with_its_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key `trainer.learning_rate`"):
        load_config(PipelineConfig, path)


def test_yaml_syntax_errors_and_repeated_keys_are_one_line_naming_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  total_steps: 2\ntrainer:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"c.yaml:5: not valid YAML") as info:
        load_config(PipelineConfig, path)
    assert "\n" not in str(info.value)
    # YAML keeps the last of two equal keys: a second section would reset the first's keys silently
    path.write_text("rollout:\n  temperature: 0.7\nrun:\n  total_steps: 3\nrollout:\n  threads: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml:5: not valid YAML \(key 'rollout' appears twice"):
        load_config(PipelineConfig, path)
    # merge keys still work, and a key may override what they merged in
    path.write_text("rollout: &r\n  temperature: 0.7\n  threads: 2\nqueue: {}\n")
    load_config(PipelineConfig, path)
    path.write_text("base: &b {temperature: 0.7, threads: 2}\n")
    import yaml

    from meshrl.config import _UniqueKeyLoader

    merged = yaml.load("base: &b {t: 0.7, u: 2}\nrollout:\n  <<: *b\n  t: 0.5\n", Loader=_UniqueKeyLoader)
    assert merged["rollout"] == {"t": 0.5, "u": 2}


@pytest.mark.parametrize(("overrides", "message"), [
    (["run.step_timeout_s=0"], "`run.step_timeout_s`: must be a finite number of seconds >= 10"),
    (["run.step_timeout_s=0.01"], "(a role's start-up waits that long), got 0.01"),
    (['run.output_dir=""'], "`run.output_dir`: empty; the run would write into the current directory"),
    (["run.output_dir=' '"], "`run.output_dir`: empty"),
    (["run.overwrite=true", "run.resume=latest"], "`run.overwrite`: true deletes the run in runs/async_ppo, and "
                                                  "run.resume=latest continues it: give one of them"),
    (["run.eval_every=-3"], "`run.eval_every`: must be >= 0"),
    (["run.num_cpus=0"], "`run.num_cpus`: must be >= 1"),
    (["run.eval_max_new_tokens=0"], "`run.eval_max_new_tokens`: must be >= 1"),
    (["cluster.placement_timeout_s=0"], "`cluster.placement_timeout_s`: must be a finite number of seconds > 0"),
    (["cluster.trainer.resources={GPU: 1}"], "`cluster.trainer.resources`: {'GPU': 1.0}: give Ray resource names"),
    (["cluster.reward.resources={cpu_node: 0}"], "`cluster.reward.resources`: {'cpu_node': 0.0}"),
    (["cluster.rollout.pack=maybe"], "`cluster.rollout.pack`: Expected `bool`"),
])
def test_validate_refuses_run_values_that_would_fail_mid_run(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, None, overrides).validate()
    assert message in str(info.value)


def test_an_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    for path in (tmp_path / "afile", tmp_path / "afile" / "run"):
        with pytest.raises(ConfigError, match=f"`run.output_dir`: {tmp_path / 'afile'} is a file, not a directory"):
            load_config(PipelineConfig, None, [f"run.output_dir={path}"]).validate()


def test_a_bad_fault_schedule_is_a_config_error(monkeypatch):
    """MESHRL_FAULTS was parsed when meshrl.faults was imported: a typo was a traceback from an import."""
    monkeypatch.setenv("MESHRL_FAULTS", "garbage")
    with pytest.raises(ConfigError, match=r"^MESHRL_FAULTS: 'garbage' is not point=n with a point of rollout.generate"):
        PipelineConfig().validate()
    monkeypatch.setenv("MESHRL_FAULTS", "reward.score=2")
    monkeypatch.delenv("MESHRL_FAULTS_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"^MESHRL_FAULTS is set but MESHRL_FAULTS_DIR is not"):
        PipelineConfig().validate()


def test_cuda_on_a_cluster_without_enough_gpus_is_refused_at_start_naming_the_key(ray_cluster):
    """The cluster decides, once the run is connected to it, not validate(): its verdict read
    ray.is_initialized(), so a config's error depended on whether an earlier test had started Ray."""
    import ray

    from meshrl.pipeline.startup import settle_devices

    for overrides in (["trainer.device=cuda"], ["placement=colocated", "trainer.device=cuda"]):
        load_config(PipelineConfig, None, overrides).validate()  # a config's own verdict: no process state in it
    gpus = int(ray.cluster_resources().get("GPU", 0))  # one more than the cluster has, on any machine
    cases = [(["trainer.device=cuda", f"trainer.dp={gpus + 1}"], "trainer.device", f"{gpus + 1} for the trainer"),
             (["rollout.engine.device=cuda", f"rollout.num_workers={gpus + 1}"], "rollout.engine.device",
              f"{gpus + 1} for the engines")]
    for overrides, key, wants in cases:
        cfg = load_config(PipelineConfig, None, overrides).validate()
        with pytest.raises(ConfigError, match=rf"`{key}`: cuda needs {wants}.*, but the Ray cluster has {gpus} GPU"):
            settle_devices(cfg, echo=lambda _: None)


def test_validate_checks_paths_and_cross_component_rules(tmp_path):
    with pytest.raises(ConfigError, match="`model.path`.*does not exist"):
        load_config(PipelineConfig, None, [f"model.path={tmp_path / 'missing'}"]).validate()
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(PipelineConfig, None, [f"model.path={model}"]).validate()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_config(PipelineConfig, None, [f"model.path={model}"]).validate()
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model.safetensors is not a whole safetensors file"):  # a copy cut short
        load_config(PipelineConfig, None, [f"model.path={model}"]).validate()
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    with pytest.raises(ConfigError, match="has no tokenizer"):  # transformers would make an empty one
        load_config(PipelineConfig, None, [f"model.path={model}"]).validate()
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        load_config(PipelineConfig, None, [f"model.path={model}"]).validate()
    with pytest.raises(ConfigError, match="not a multiple of algo.samples_per_prompt=4"):
        load_config(PipelineConfig, None, ["algo=grpo", "trainer.samples_per_step=14"]).validate()
    with pytest.raises(ConfigError, match="`task.train_file`"):
        load_config(PipelineConfig, None, ["task.kind=file"]).validate()
    # the file keys without task.kind=file trained on addition, silently
    with pytest.raises(ConfigError, match="`task.kind`: task.train_file/test_file are set, but task.kind=addition"):
        load_config(PipelineConfig, None, [f"task.train_file={model / 'config.json'}"]).validate()
    # the engine refused every request at its first generate, after the warm start and the roles
    with pytest.raises(ConfigError, match="`rollout.engine.max_batch_size`: 4 rows cannot hold one prompt's "
                                          "algo.samples_per_prompt=8"):
        load_config(PipelineConfig, None, ["algo=grpo", "algo.samples_per_prompt=8", "trainer.samples_per_step=64",
                                           "rollout.prompts_per_request=8", "rollout.engine.max_batch_size=4"]).validate()


def test_sizes_that_could_never_fill_a_batch_are_refused():
    """Each of these used to pass validate() and then wait out its timeouts (600 s) mid-run."""
    base = ["trainer.samples_per_step=8", "algo=grpo", "algo.samples_per_prompt=2"]
    cases = [
        # 3 prompts x 2 = 6-sample requests, 8 per version, no slack at max_staleness=0
        (["queue.max_staleness=0", "rollout.prompts_per_request=3"], "not a multiple of 6"),
        # one request (32 x 2) is larger than all that max_staleness=0 admits (8)
        (["queue.max_staleness=0", "rollout.prompts_per_request=32"], "admits at most 8 samples"),
        # the queue cannot hold one batch of 8 samples of up to 64 tokens
        (["rollout.prompts_per_request=4", "queue.capacity_tokens=100"], "cannot hold a train batch short"),
        # it holds a batch (8 x 64 = 512 tokens), but not 3 groups of 2 queued plus the next 6-sample
        # request (12 x 64 = 768): that put waits for room, the train step for that put
        (["queue.max_staleness=1", "rollout.prompts_per_request=3", "queue.capacity_tokens=700"],
         r"\(trainer.samples_per_step=8 - algo.samples_per_prompt=2\) plus one request's 6 samples, of up to 64 "
         r"tokens each \(768\)"),
    ]
    for extra, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            load_config(PipelineConfig, None, base + extra).validate()
    # with one version of slack, 6-sample requests do cover every version
    load_config(PipelineConfig, None, base + ["queue.max_staleness=1", "rollout.prompts_per_request=3"]).validate()


@pytest.mark.parametrize("overrides,message", [
    (["rollout.tp_size=2", "placement=colocated"], "`rollout.tp_size`: placement=colocated"),
    (["rollout.tp_size=2", "reshard.apply=in_place"], "`reshard.apply`: tensor-parallel engines"),
    (["rollout.tp_size=3"], r"`rollout.tp_size`: the model's \{'num_attention_heads': 4, 'num_key_value_heads': 2, "
                            r"'intermediate_size': 512\} do not split over tp_size=3"),
    (["rollout.tp_size=0"], "rollout.tp_size must be >= 1"),
])
def test_tensor_parallel_rollouts_are_checked_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PipelineConfig, None, overrides).validate()
    load_config(PipelineConfig, None, ["rollout.tp_size=2"]).validate()  # the embedded model splits over 2


def test_the_capacity_check_reads_a_real_models_positions(tiny_model):
    """With model.path set and rollout.engine.max_seq_len=0 the queue's deadlock check was skipped
    (its sequence length fell back to 0); the engine serves min(positions, 4096)."""
    model = tiny_model
    small = ["trainer.samples_per_step=8", "rollout.prompts_per_request=2", "queue.capacity_tokens=64"]
    with pytest.raises(ConfigError, match="`queue.capacity_tokens`: 64 cannot hold a train batch"):
        load_config(PipelineConfig, None, [f"model.path={model}", *small]).validate()


def test_the_examples_model_flag_is_taken_verbatim_and_alone(tmp_path):
    """--model went through the YAML parser as `model.path=DIR`: `2024` was an int, `null` meant the
    embedded default, and `a #2` was cut at the comment; with model.path= too, one silently won."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        from async_ppo import parse
    finally:
        sys.path.pop(0)
    for name in ("2024", "null", "a #2"):
        with pytest.raises(ConfigError, match=f"`model.path`: .*{name} does not exist"):
            parse(["--model", str(tmp_path / name)]) if name != "null" else parse(["--model", name])
    with pytest.raises(ConfigError, match="--model DIR and a model.path= override both name the model"):
        parse(["--model", str(tmp_path), "model.path=/elsewhere"])


def test_answers_longer_than_a_completion_are_reported_at_start(tmp_path, capsys):
    """The task's reward matches an answer whole: one longer than rollout.max_new_tokens can never earn
    it. All of them fail the run at start; some print a warning naming the key."""
    from meshrl.pipeline.startup import check_prompts
    from meshrl.tasks import build_task

    def check(*overrides: str) -> None:
        cfg = load_config(PipelineConfig, None, ["task.digits=3", f"run.output_dir={tmp_path}", *overrides])
        check_prompts(cfg, build_task(cfg.task))

    with pytest.raises(ConfigError, match=r"`rollout.max_new_tokens`: 500 of the 500 test answers are longer than "
                                          r"rollout.max_new_tokens=1 tokens .*: raise it"):
        check("rollout.max_new_tokens=1")  # (a few train answers have one digit: a warning for those)
    check("rollout.max_new_tokens=3")
    out = capsys.readouterr().out
    assert "warning: " in out and "train answers are longer than rollout.max_new_tokens=3 tokens" in out
    assert "test answers are longer than rollout.max_new_tokens=3 tokens" in out
    check("rollout.max_new_tokens=4", "run.eval_max_new_tokens=3")
    assert "test answers are longer than run.eval_max_new_tokens=3 tokens" in capsys.readouterr().out
    check("rollout.max_new_tokens=4")
    assert "warning" not in capsys.readouterr().out


def test_a_section_with_every_key_commented_out_changes_nothing(tmp_path):
    """YAML reads `run:` followed only by comments as null: the file failed with "`run`: Expected
    `object`, got `null`". An override `run=null` is still refused."""
    (tmp_path / "c.yaml").write_text("run:\n  # total_steps: 5\nqueue:\n  max_staleness: 2\n")
    cfg = load_config(PipelineConfig, tmp_path / "c.yaml")
    assert cfg.run == PipelineConfig().run and cfg.queue.max_staleness == 2
    with pytest.raises(ConfigError, match="`run`: Expected `object`, got `null`"):
        load_config(PipelineConfig, None, ["run=null"])


def test_each_role_has_its_placement_and_reward_workers_spread():
    cfg = load_config(PipelineConfig, None, ["cluster.trainer.resources={trainer_node: 0.01}",
                                             "cluster.rollout.labels={accelerator: H200}"]).validate()
    assert cfg.cluster.trainer.resources == {"trainer_node": 0.01} and cfg.cluster.role("hybrid") is cfg.cluster.trainer
    assert cfg.cluster.rollout.labels == {"accelerator": "H200"} and cfg.cluster.rollout.pack
    assert not cfg.cluster.reward.pack and cfg.cluster.role("reward_model") is cfg.cluster.reward


@pytest.mark.parametrize("overrides, in_place", [
    ([], False),  # the one rollout worker holds the sampler: its death resumes the run
    (["rollout.num_workers=2"], True),
    (["run.max_worker_restarts=0", "rollout.num_workers=2"], False),
    (["trainer.sync_interval=2", "run.checkpoint_every=10", "rollout.num_workers=2"], True),
    (["rollout.tp_size=2", "rollout.num_workers=1"], False),
    (["placement=colocated"], False),
])
def test_where_a_rollout_worker_is_restarted_in_place_rather_than_resumed(overrides, in_place):
    from meshrl.pipeline.revival import restarts_rollout_in_place

    assert restarts_rollout_in_place(load_config(PipelineConfig, None, overrides)) is in_place


def test_a_chunk_of_no_time_is_refused():
    with pytest.raises(ConfigError, match="`run.chunk_s`: must be a positive number of seconds, got 0"):
        load_config(PipelineConfig, None, ["run.chunk_s=0"]).validate()
