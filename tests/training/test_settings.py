"""The typed settings: every validated flag lands in one frozen section, and no section can be changed."""

import dataclasses
import json

import pytest

from megatron_ds.arguments import parse_args, validate
from megatron_ds.arguments.resolver import DERIVED
from megatron_ds.arguments.settings import NOT_IN_SETTINGS, SECTIONS, Settings, settings_from


@pytest.fixture
def files(tmp_path):
    for name in ("corpus.bin", "corpus.idx", "merges.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                                  "zero_optimization": {"stage": 1}}))
    return tmp_path


def argv(d, *extra):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--train-iters", "10", "--lr", "1e-3", "--data-path", str(d / "corpus"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(d / "vocab.json"), "--merge-file", str(d / "merges.txt"), *extra]


CONFIGS = [
    ["--micro-batch-size", "2"],
    ["--micro-batch-size", "2", "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--bf16",
     "--zero-stage", "1", "--save", "ckpt", "--save-interval", "5", "--swiglu", "--normalization", "RMSNorm"],
    ["--deepspeed", "--deepspeed_config", "ds.json", "--bf16", "--zero-stage", "1", "--ds-sequence-parallel-size", "2"],
]


@pytest.mark.parametrize("extra", CONFIGS)
def test_sections_cover_every_validated_flag(files, extra, monkeypatch):
    monkeypatch.chdir(files)
    args = parse_args(argv(files, *extra), env={})
    settings = validate(args, 2)
    assert isinstance(settings, Settings) and settings == settings_from(settings.flags)
    owners = {}
    for name, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            assert field.name not in owners, f"{field.name} is in both {owners[field.name]} and {name}"
            owners[field.name] = name
    assert not set(owners) & set(NOT_IN_SETTINGS)
    missing = set(vars(args)) - set(owners) - set(NOT_IN_SETTINGS)
    assert not missing, f"validated attributes in no settings section: {sorted(missing)}"
    for name, section in owners.items():  # a field no rule derives is the parsed value (lists as tuples)
        value = getattr(args, name, None) if name not in DERIVED else getattr(getattr(settings, section), name)
        assert getattr(getattr(settings, section), name) == (tuple(value) if isinstance(value, list) else value)


def test_settings_are_frozen(files):
    settings = validate(parse_args(argv(files, "--micro-batch-size", "2"), env={}), 1)
    for name in SECTIONS:
        section = getattr(settings, name)
        for field in dataclasses.fields(section):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(section, field.name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.model = None
    assert settings.layout.world_size == 1 and settings.optimizer.lr == 1e-3 and settings.model.num_layers == 4
    assert isinstance(settings.data.data_path, tuple)
    variant = dataclasses.replace(settings.layout, tensor_model_parallel_size=2)  # a variant is a new section
    assert variant.tensor_model_parallel_size == 2 and settings.layout.tensor_model_parallel_size == 1


def test_the_flag_view_is_frozen(files):
    import copy
    import pickle

    from megatron_ds.arguments.settings import FrozenNamespace, replace_args

    args = parse_args(argv(files, "--micro-batch-size", "2"), env={})
    args.lr = 2e-3  # before validation the flags may still be filled
    args = validate(args, 1).flags
    assert isinstance(args, FrozenNamespace) and args.lr == 2e-3
    with pytest.raises(dataclasses.FrozenInstanceError, match="args.lr: the settings are fixed at validation"):
        args.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(args, "new_name", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        del args.lr
    variant = replace_args(args, tensor_model_parallel_size=2)  # a variant is a new Namespace
    assert variant.tensor_model_parallel_size == 2 and args.tensor_model_parallel_size == 1
    assert isinstance(variant, FrozenNamespace) and vars(variant).keys() == vars(args).keys()
    with pytest.raises(AttributeError, match="no such setting"):
        replace_args(args, not_a_flag=1)
    for twin in (copy.copy(args), copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        assert vars(twin) == vars(args) and isinstance(twin, FrozenNamespace)


def test_stored_flags_round_trip_and_older_checkpoints_get_the_parsers_defaults(files, monkeypatch):
    """A checkpoint stores flags_of(settings) as JSON; settings_from_stored rebuilds the same Settings, and a dict
    from before a flag existed gets that flag's default (what the older run effectively had)."""
    from megatron_ds.arguments import settings_from_stored
    from megatron_ds.arguments.settings import flags_of
    from megatron_ds.checkpoint.metadata import jsonable

    monkeypatch.chdir(files)
    settings = validate(parse_args(argv(files, *CONFIGS[1], "--openai-gelu", "--pipeline-model-parallel-size", "2",
                                        "--decoder-last-pipeline-num-layers", "1"), env={}), 4)
    stored = json.loads(json.dumps(jsonable(flags_of(settings))))
    assert settings_from_stored(stored) == settings

    older = {k: v for k, v in stored.items()
             if k not in ("openai_gelu", "tp_comm_overlap", "decoder_last_pipeline_num_layers", "data_order",
                          "ds_sequence_parallel_size", "world_size")}
    rebuilt = settings_from_stored(older)
    assert rebuilt.model.openai_gelu is False and rebuilt.runtime.tp_comm_overlap is None
    assert rebuilt.layout.decoder_last_pipeline_num_layers is None and rebuilt.layout.ds_sequence_parallel_size == 1
    assert rebuilt.data.data_order == "megatron"
    assert rebuilt.layout.world_size is None  # derived by validation only: no default to stand in
    assert rebuilt.model == dataclasses.replace(settings.model, openai_gelu=False)
