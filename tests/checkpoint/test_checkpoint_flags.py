"""--ckpt-step, --no-ckpt-fallback and --async-save at validation: what each needs, refused before any rank starts."""

import pytest

from megatron_ds.arguments import ConfigError, parse_args, validate


def argv(tmp_path, *extra):
    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--data-path", str(tmp_path / "corpus"),
            "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"), *extra]


@pytest.mark.parametrize("extra, flag, text", [
    (["--ckpt-step", "5"], "--ckpt-step", "needs --load DIR, the directory whose iter_N it loads"),
    (["--load", "c", "--ckpt-step", "-1"], "--ckpt-step", "must be an iteration >= 0 (got -1)"),
    (["--load", "c", "--save", "c", "--ckpt-step", "5", "--max-restarts", "1"], "--ckpt-step",
     "every restart would load that iteration again"),
    (["--async-save"], "--async-save", "needs --save DIR"),
])
def test_refused_naming_the_flag(tmp_path, extra, flag, text):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(argv(tmp_path, *extra), env={}), 1)
    assert err.value.flag == flag and text in str(err.value), str(err.value)


def test_accepted_into_the_checkpoint_settings(tmp_path):
    settings = validate(parse_args(argv(tmp_path, "--load", "c", "--save", "c", "--ckpt-step", "5",
                                        "--no-ckpt-fallback", "--async-save"), env={}), 1)
    c = settings.checkpoint
    assert (c.ckpt_step, c.no_ckpt_fallback, c.async_save) == (5, True, True)
