"""Refusals of the batch and length flags, of a DeepSpeed config file that disagrees with a flag, and a property
test over the flag table: every combination ends in settings or one ConfigError line, never a traceback, and the
same one whatever the order of the rules."""

import argparse
import json
import os
import random
import subprocess
import sys

import pytest

from megatron_ds.arguments import ConfigError, build_parser, parse_args, validate
from megatron_ds.arguments.rules import RULES
from tests.training.test_arguments import base, files  # noqa: F401 (the fixture)


def refusal(argv: list[str], world: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate(parse_args(argv, env={}), world)
    return err.value


@pytest.mark.parametrize("flag", ["--global-batch-size", "--micro-batch-size", "--train-iters", "--train-samples"])
@pytest.mark.parametrize("value", ["0", "-8"])
def test_batch_and_length_must_be_positive(files, flag, value):  # noqa: F811
    argv = base(files, flag, value)
    if flag == "--train-samples":
        argv.remove("--train-iters")
        argv.remove("10")
    err = refusal(argv)
    assert (err.flag, err.rule) == (flag, f"must be positive (got {value})")


def ds_config(files, config: dict) -> list[str]:  # noqa: F811
    path = files["dir"] / "ds.json"
    path.write_text(json.dumps(config))
    return ["--deepspeed_config", str(path)]


@pytest.mark.parametrize("config, extra, flag, named", [
    ({"zero_optimization": {"stage": 0}}, ["--use-distributed-optimizer"], "--use-distributed-optimizer",
     "zero_optimization.stage=0"),
    ({"zero_optimization": {"stage": 0}}, ["--use-distributed-optimizer", "--zero-stage", "0"],
     "--use-distributed-optimizer", "zero_optimization.stage=0"),
    ({"zero_optimization": {"stage": 2}}, ["--zero-stage", "1"], "--zero-stage", "zero_optimization.stage=2"),
    ({"bf16": {"enabled": True}}, [], "--bf16", "enables bf16"),
    ({"bf16": {"enabled": False}}, ["--bf16"], "--bf16", "bf16.enabled=false"),
    ({"fp16": {"enabled": True}}, [], "--fp16", "enables fp16"),
    ({"train_batch_size": 8}, ["--global-batch-size", "4"], "--global-batch-size", "train_batch_size=8"),
    ({"train_micro_batch_size_per_gpu": 4}, [], "--micro-batch-size", "train_micro_batch_size_per_gpu=4"),
    ({"gradient_accumulation_steps": 3}, ["--global-batch-size", "4"], "--global-batch-size",
     "gradient_accumulation_steps=3"),
])
def test_deepspeed_config_disagreement_names_both(files, config, extra, flag, named):  # noqa: F811
    ds = ds_config(files, config)
    err = refusal(base(files, *ds, *extra))
    assert err.flag == flag and named in err.rule and ds[1] in err.rule, str(err)


def test_distributed_optimizer_agrees_with_a_file_that_shards(files):  # noqa: F811
    settings = validate(parse_args(base(files, *ds_config(files, {"zero_optimization": {"stage": 1}}),
                                        "--use-distributed-optimizer"), env={}), 1)
    assert settings.optimizer.zero_stage == 1


VALUES = {int: ["-1", "0", "1", "2", "4", "8", "64"], float: ["-1", "0", "1e-5", "0.5", "1", "3"],
          None: ["x", "", "0"]}
SKIPPED = {"help", "data_path"}  # --data-path: the base's corpus stays (a random prefix only says "not found")


def flag_words(action: argparse.Action, rng: random.Random) -> list[str]:
    """One use of the flag, drawn from what the parser itself accepts (choices, type, nargs, switch)."""
    flag = rng.choice(action.option_strings)
    if action.nargs == 0:
        return [flag]
    if action.choices is not None:
        value = str(rng.choice(list(action.choices)))
    else:
        value = rng.choice(VALUES.get(action.type, VALUES[None]))
    count = rng.choice([1, 2]) if action.nargs in ("+", "*") else 1
    return [flag, *[value] * count]


def draw(rng: random.Random, actions: list[argparse.Action], files) -> list[str]:  # noqa: F811
    argv = base(files)
    for action in rng.sample(actions, rng.randint(1, 6)):
        argv += flag_words(action, rng)
    return argv


def parser_actions() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.option_strings and a.dest not in SKIPPED]


def outcome(argv: list[str], world: int, order=None) -> str:
    """'ok', or the refusal's one line; anything else (a traceback) propagates."""
    try:
        validate(parse_args(argv, env={}), world, order)
    except ConfigError as err:
        assert "\n" not in str(err), str(err)
        return str(err)
    return "ok"


def test_flag_combinations_end_in_settings_or_one_line(files):  # noqa: F811
    rng, actions, outcomes = random.Random(55), parser_actions(), {}
    for _ in range(2000):
        argv = draw(rng, actions, files)
        world = rng.choice([1, 2, 4])
        order = rng.sample(RULES, len(RULES))
        try:
            line = outcome(argv, world)
            assert outcome(argv, world, order) == line  # the rules in another order: the same result
        except Exception as err:  # the defect this test exists to find: name the command line
            raise AssertionError(f"world {world}: {' '.join(argv)}") from err
        outcomes[line] = outcomes.get(line, 0) + 1
    assert outcomes.get("ok", 0) >= 100 and len(outcomes) >= 50, sorted(outcomes.items(), key=lambda kv: -kv[1])


def test_drawn_combinations_through_the_command(demo_corpus, tmp_path):
    """A few of them through `entrypoint train --dry-run` itself (a real corpus: the command reads its token ids):
    exit 0 or 2, stderr one line, no traceback."""
    corpus = dict(prefix=demo_corpus.prefix, vocab=demo_corpus.vocab_file, merges=demo_corpus.merge_file, dir=tmp_path)
    rng, actions = random.Random(7), parser_actions()
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}}
    codes = set()
    for argv in [base(corpus), *[draw(rng, actions, corpus) for _ in range(5)]]:  # the base alone: exit 0
        proc = subprocess.run([sys.executable, "-c", "import entrypoint, sys; sys.exit(entrypoint.main())", "train",
                               "--dry-run", *argv], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode in (0, 2), proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        if proc.returncode == 2:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("entrypoint train: error:")]
            assert len(errors) == 1, proc.stderr
        codes.add(proc.returncode)
    assert codes == {0, 2}, codes
