"""megatron_ds/env_settings.py: the one place MDS_* variables are read, and their typed accessor."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds import env_settings
from megatron_ds.env_settings import SettingError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"MDS_[A-Z0-9_]+")


def _sources() -> list[Path]:
    """The package and the command: where no MDS_* name may be spelled outside env_settings.py."""
    return sorted((ROOT / "megatron_ds").rglob("*.py")) + [ROOT / "entrypoint.py"]


def test_only_env_settings_spells_an_mds_variable():
    """A string that is exactly an MDS_* name (an os.environ key, a constant, a dict key) appears in
    env_settings.py only: the others ask its settings (``PROFILE.get(env)``) and write through ``PROFILE.name``.
    Names inside prose (docstrings, help texts, f-string text) are fine."""
    offenders = []
    for path in _sources():
        if path.name == "env_settings.py" and path.parent.name == "megatron_ds":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    NAME.fullmatch(node.value) or node.value == "MDS_"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "MDS_* names spelled outside megatron_ds/env_settings.py:\n" + "\n".join(offenders)


def test_no_module_calls_the_environment_with_an_mds_name():
    """The grep twin of the test above, for the forms a reader would look for."""
    pattern = re.compile(r"""(environ|getenv|env)\s*(\.get\(|\[|\()\s*f?["']MDS_""")
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in _sources()
            if path.name != "env_settings.py"
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_every_mds_name_the_package_mentions_is_defined():
    """Docs and help texts name only variables that exist (a renamed one would leave its old name behind)."""
    defined = {setting.name for setting in env_settings.ALL}
    mentioned = {name for path in _sources() for name in NAME.findall(path.read_text())}
    assert mentioned - defined == set()


def test_each_setting_is_defined_once_and_listed():
    module_settings = [v for v in vars(env_settings).values() if isinstance(v, env_settings.Setting)]
    assert sorted(s.name for s in module_settings) == sorted(s.name for s in env_settings.ALL)
    assert len({s.name for s in env_settings.ALL}) == len(env_settings.ALL)
    for setting in env_settings.ALL:
        assert NAME.fullmatch(setting.name) and setting.kind and setting.doc, setting
        assert setting.name in env_settings.table()


def test_nothing_is_read_at_import():
    """Importing the package's modules that read settings touches no MDS_* variable: a malformed value in the
    environment breaks nothing until a setting is asked for."""
    code = ("import os\n"
            "for s in ('MDS_TP_COLLECTIVES', 'MDS_INDUCTOR_OPTIONS', 'MDS_PEAK_TFLOPS', 'MDS_FUSED_CROSS_ENTROPY',"
            " 'MDS_CPU_BIND', 'MDS_SIGNAL_GRACE', 'MDS_TEST_SLOW_RANK', 'MDS_ALLOW_TP_COMPILE'):\n"
            "    os.environ[s] = 'not-a-valid-value'\n"
            "import megatron_ds.parallel.mappings, megatron_ds.parallel.cross_entropy, megatron_ds.model.gpt\n"
            "import megatron_ds.runtime.bootstrap, megatron_ds.runtime.progress, megatron_ds.runtime.doctor\n"
            "import megatron_ds.training.metrics, megatron_ds.training.cli, megatron_ds.torch_support\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("setting, env, value", [
    (env_settings.PROFILE, {}, None),
    (env_settings.PROFILE, {"MDS_PROFILE": "lumi"}, "lumi"),
    (env_settings.PROFILE_PATH, {"MDS_PROFILE_PATH": "/a::/b"}, ("/a", "/b")),
    (env_settings.CPU_BIND, {}, True),
    (env_settings.CPU_BIND, {"MDS_CPU_BIND": "none"}, False),
    (env_settings.CPU_BIND, {"MDS_CPU_BIND": "OFF"}, False),
    (env_settings.RANK_LD_PRELOAD, {"MDS_RANK_LD_PRELOAD": "a.so::b.so"}, ("a.so", "b.so")),
    (env_settings.SUPERVISED, {"MDS_SUPERVISED": "1"}, True),
    (env_settings.TEST_SLOW_RANK, {"MDS_TEST_SLOW_RANK": "1:0.25"}, (1, 0.25)),
    (env_settings.SIGNAL_GRACE, {}, 300.0),
    (env_settings.SIGNAL_GRACE, {"MDS_SIGNAL_GRACE": ""}, 300.0),  # empty is unset
    (env_settings.SIGNAL_GRACE, {"MDS_SIGNAL_GRACE": "30"}, 30.0),
    (env_settings.PEAK_TFLOPS, {"MDS_PEAK_TFLOPS": "989"}, 989.0),
    (env_settings.INDUCTOR_OPTIONS, {}, None),
    (env_settings.INDUCTOR_OPTIONS, {"MDS_INDUCTOR_OPTIONS": '{"fallback_random": false}'}, {"fallback_random": False}),
    (env_settings.TP_COLLECTIVES, {}, ""),
    (env_settings.TP_COLLECTIVES, {"MDS_TP_COLLECTIVES": "inplace"}, "inplace"),
    (env_settings.ALLOW_TP_COMPILE, {"MDS_ALLOW_TP_COMPILE": "1"}, True),
    (env_settings.FUSED_CROSS_ENTROPY, {}, None),
    (env_settings.FUSED_CROSS_ENTROPY, {"MDS_FUSED_CROSS_ENTROPY": "0"}, False),
])
def test_values_and_defaults(setting, env, value):
    assert setting.get(env) == value
    assert setting.is_set(env) == bool(env.get(setting.name))


@pytest.mark.parametrize("setting, text, expected", [
    (env_settings.PEAK_TFLOPS, "fast", "must be a number"),
    (env_settings.PEAK_TFLOPS, "0", "must be a number > 0"),
    (env_settings.SIGNAL_GRACE, "-1", "must be a number of seconds >= 0"),
    (env_settings.CPU_BIND, "maybe", "must be 1 or 0"),
    (env_settings.FUSED_CROSS_ENTROPY, "2", "must be 1 or 0"),
    (env_settings.TEST_SLOW_RANK, "0.25", "must be RANK:SECONDS"),
    (env_settings.INDUCTOR_OPTIONS, "fallback_random", "is not JSON"),
    (env_settings.INDUCTOR_OPTIONS, "[1, 2]", "must be a JSON object"),
    (env_settings.TP_COLLECTIVES, "sideways", "must be one of functional, inplace"),
])
def test_a_malformed_value_names_the_variable(setting, text, expected):
    with pytest.raises(SettingError) as err:
        setting.get({setting.name: text})
    assert str(err.value).startswith(f"{setting.name}={text!r} {expected}"), str(err.value)
    assert (err.value.name, err.value.value) == (setting.name, text)
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("MDS_PEAK_TFLOPS", "312")
    assert env_settings.PEAK_TFLOPS.get() == 312.0
    monkeypatch.delenv("MDS_PEAK_TFLOPS")
    assert env_settings.PEAK_TFLOPS.get() is None
