"""`validate` is a function of the parsed flags: it changes nothing it is given, and its rules give the same
Settings (or the same refusal) in any order."""

import copy
import json
import random

import pytest

from megatron_ds.arguments import ConfigError, parse_args, validate
from megatron_ds.arguments.rules import RULES
from tests.training.test_arguments import base, files  # noqa: F401 (the fixture)


def flag_sets(files) -> list[tuple[list[str], int]]:  # noqa: F811
    ds = files["dir"] / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                              "gradient_accumulation_steps": 2}))
    tp2 = ["--tensor-model-parallel-size", "2"]
    return [
        (base(files), 1),
        (base(files, *tp2, "--sequence-parallel", "--global-batch-size", "16", "--swiglu"), 4),
        (base(files, "--deepspeed_config", str(ds), "--bf16", "--use-distributed-optimizer"), 4),
        (base(files, "--checkpoint-activations", "--pipeline-model-parallel-size", "2", "--train-tokens", "5000"), 2),
        (base(files, "--num-experts", "4", "--moe-expert-parallel-size", "2", "--zero-stage", "1",
              "--create-moe-param-group"), 2),
        (base(files, "--sequence-parallel", "--recompute-activations", "--lr-warmup-fraction", "0.1"), 1),
        (base(files, "--deepspeed_config", str(ds), "--bf16", "--zero-stage", "2"), 4),  # refused: the file says 1
        (base(files, "--global-batch-size", "0", "--clip-grad", "-1", "--tp-comm-overlap", "reorder"), 1),  # 3 rules
        (base(files, "--recompute-method", "block", "--min-lr", "1", *tp2), 1),  # two rules and the layout refuse
    ]


def outcome(argv: list[str], world: int, order=None):
    try:
        settings = validate(parse_args(argv, env={}), world, order)
    except ConfigError as err:
        return str(err)
    return settings, settings.notices


def test_validate_changes_nothing_it_is_given(files):  # noqa: F811
    for argv, world in flag_sets(files):
        args = parse_args(argv, env={})
        before = copy.deepcopy(vars(args))
        try:
            validate(args, world)
        except ConfigError:
            pass
        assert vars(args) == before and type(args).__name__ == "Namespace"


def test_rules_give_the_same_result_in_any_order(files):  # noqa: F811
    results = set()
    for argv, world in flag_sets(files):
        expected = outcome(argv, world)
        results.add(isinstance(expected, str))
        for seed in range(25):
            order = random.Random(seed).sample(RULES, len(RULES))
            assert outcome(argv, world, order) == expected, (argv, seed)
    assert results == {True, False}  # both settings and refusals among them


def test_of_several_refusals_the_earliest_rule_speaks(files):  # noqa: F811
    argv, world = flag_sets(files)[-2]
    with pytest.raises(ConfigError) as err:
        validate(parse_args(argv, env={}), world, order=RULES[::-1])
    assert err.value.flag == "--global-batch-size" and "must be positive (got 0)" in err.value.rule
