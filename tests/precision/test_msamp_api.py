"""Every MS-AMP name, attribute and keyword argument megatron_ds uses exists in MS-AMP v0.4.0 (the MS-AMP image's
pin, 51f34acd...), read statically from its sources: MS-AMP needs CUDA and its compiled extensions to import.

- test_every_msamp_use_is_listed (always runs): the msamp names and keywords megatron_ds's code uses are the ones
  fp8_msamp.MSAMP_API lists, so the list the marked test checks is complete.
- the upstream_src tests (CI cannot fetch MS-AMP): MDS_MSAMP_SRC=<checkout of Azure/MS-AMP at 51f34acd...>,
  `pytest -m upstream_src tests/precision`.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest
from fp8_sources import SourceTree, accepted_names, mentions, takes_any_keyword

from megatron_ds.precision.fp8_msamp import MSAMP_API, MSAMP_ATTRIBUTES, MSAMP_COMMIT

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "megatron_ds").rglob("*.py"), ROOT / "entrypoint.py"])


def msamp_uses(path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(``module:qualified.name``, keywords passed, line) for every msamp name a file imports, reads or calls."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> "module:name" or "module" (an imported submodule)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "msamp":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    found = []

    def resolve(node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in aliases):
            return None
        module, _, name = aliases[node.id].partition(":")
        dotted = [name, *reversed(parts)]
        if module == "msamp" and name == "deepspeed":  # `from msamp import deepspeed`: the module
            return f"msamp.deepspeed:{'.'.join(dotted[1:])}" if len(dotted) > 1 else "msamp:deepspeed"
        return f"{module}:{'.'.join(dotted)}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = resolve(node.func)
            if name:
                found.append((name, tuple(k.arg for k in node.keywords if k.arg), node.lineno))
        elif isinstance(node, ast.Attribute):
            name = resolve(node)
            if name:
                found.append((name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "msamp":
            found.extend((f"{node.module}:{a.name}", (), node.lineno) for a in node.names)
    return found


def test_every_msamp_use_is_listed():
    uses = [(p, *u) for p in SOURCES for u in msamp_uses(p)]
    assert any(name == "msamp.nn:LinearReplacer.replace" for _, name, _, _ in uses)  # the scan sees our calls
    assert any(name == "msamp.deepspeed:initialize" for _, name, _, _ in uses)
    listed = {**MSAMP_API, **{k: () for k in MSAMP_ATTRIBUTES}}
    bad = []
    for path, name, keywords, line in uses:
        where = f"{path.relative_to(ROOT)}:{line}"
        if name == "msamp:deepspeed":
            continue  # the module itself; its names are checked where used
        owner, _, attribute = name.rpartition(".")
        covering = [spec for spec in listed if spec == name or spec.startswith(name + ".")
                    or (spec == owner and attribute in MSAMP_ATTRIBUTES.get(spec, ()))]
        if not covering:
            bad.append(f"{where}: {name} is not in fp8_msamp.MSAMP_API")
        elif name in MSAMP_API and set(keywords) - set(MSAMP_API[name]):
            bad.append(f"{where}: {name} called with {sorted(set(keywords) - set(MSAMP_API[name]))}, not listed")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ against MS-AMP's source (upstream_src)

@pytest.fixture(scope="module")
def msamp_source() -> SourceTree:
    source = os.environ.get("MDS_MSAMP_SRC")
    assert source, f"set MDS_MSAMP_SRC to a checkout of Azure/MS-AMP at v0.4.0 ({MSAMP_COMMIT})"
    root = Path(source)
    assert (root / "msamp" / "__init__.py").is_file(), f"{root} holds no msamp package"
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert head.strip() == MSAMP_COMMIT, f"{root} is at {head.strip()}, not the pinned {MSAMP_COMMIT}"
    else:
        assert "__version__ = '0.4.0'" in (root / "msamp" / "__init__.py").read_text(), "not MS-AMP 0.4.0"
    return SourceTree(root)


@pytest.mark.upstream_src
@pytest.mark.parametrize("spec", sorted(MSAMP_API))
def test_msamp_name_and_keywords_exist_at_the_pinned_commit(msamp_source, spec):
    module, _, qualname = spec.partition(":")
    assert qualname.split(".")[0] in msamp_source.exported(module), f"{module} does not provide {qualname}"
    node = msamp_source.find(spec)
    assert node is not None, f"{spec}: no definition in MS-AMP {MSAMP_COMMIT[:8]}"
    missing = set(MSAMP_API[spec]) - accepted_names(node)
    assert not missing or takes_any_keyword(node), f"{spec} does not take {sorted(missing)}"


@pytest.mark.upstream_src
@pytest.mark.parametrize("spec", sorted(MSAMP_ATTRIBUTES))
def test_msamp_attributes_we_rely_on_exist_at_the_pinned_commit(msamp_source, spec):
    node = msamp_source.find(spec)
    assert node is not None, f"{spec}: no definition in MS-AMP {MSAMP_COMMIT[:8]}"
    absent = [name for name in MSAMP_ATTRIBUTES[spec] if not mentions(node, name)]
    assert not absent, f"{spec} never mentions {absent}"


@pytest.mark.upstream_src
def test_msamp_levels_and_state_as_fp8_msamp_describes_them(msamp_source):
    """The facts fp8_msamp.py builds on, read from the same sources."""
    from megatron_ds.precision.fp8_msamp import MOMENT_DTYPES, ZERO_STAGES

    initialize = msamp_source.find("msamp:initialize")
    text = ast.unparse(initialize)
    # msamp.initialize: O1 moments fp32/fp32, O2 uint8/fp16
    assert "exp_avg_dtype = torch.float32" in text and "exp_avg_sq_dtype = torch.float32" in text
    assert "exp_avg_dtype = torch.uint8" in text and "exp_avg_sq_dtype = torch.float16" in text
    assert MOMENT_DTYPES["O1"] == ("float32", "float32") and MOMENT_DTYPES["O2"] == ("uint8", "float16")
    # its DeepSpeed config: O3 needs ZeRO with optimizer-state or gradient partitioning (stages 1, 2)
    check = ast.unparse(msamp_source.find("msamp.deepspeed.runtime.config:MSAMPDeepSpeedConfig._do_error_check"))
    assert "ZeroStageEnum.optimizer_states" in check and "ZeroStageEnum.gradients" in check
    assert ZERO_STAGES["O3"] == (1, 2)
    # its engine with `msamp.enabled` re-runs msamp.initialize on the model (why mds leaves the section out)
    configure = ast.unparse(msamp_source.find("msamp.deepspeed.runtime.engine:"
                                              "MSAMPDeepSpeedEngine._configure_optimizer"))
    assert "self.msamp_enabled()" in configure and "msamp_initialize(self.module" in configure
    # LinearReplacer.replace broadcasts the FP8 weights over `group` from `src_rank` (mds: the DP group)
    replace = ast.unparse(msamp_source.find("msamp.nn:LinearReplacer.replace"))
    assert "TensorDist.broadcast(fp8_weights, src=src_rank, group=group)" in replace
    # checkpoints: the FP8 weight's state-dict entry keeps its scaling meta; FP8Linear's activation metas are a
    # plain attribute (not saved); the FP8 optimizers save their FP8 master groups
    detach = ast.unparse(msamp_source.find("msamp.common.tensor:ScalingTensor.detach"))
    assert "ScalingTensor(self.value, self.meta)" in detach
    fp8_linear = msamp_source.find("msamp.nn.linear:FP8Linear")
    assert mentions(fp8_linear, "scaling_metas") and not mentions(fp8_linear, "register_buffer")
    assert mentions(msamp_source.find("msamp.deepspeed.runtime.fp8.fused_optimizer:FP8Optimizer.state_dict"),
                    "fp8_master_groups")
    assert mentions(msamp_source.find(
        "msamp.deepspeed.runtime.zero.fp8_stage_1_and_2:FP8DeepSpeedZeroOptimizer.state_dict"),
        "SINGLE_PARTITION_OF_FP8_GROUPS")
    lb_state = ast.unparse(msamp_source.find("msamp.optim.optimizer:LBOptimizer.state_dict"))
    assert "self.state.items()" in lb_state  # LBAdamW's moments (ScalingTensors) are its state
