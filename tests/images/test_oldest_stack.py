"""megatron_ds must run in the MS-AMP image: Python 3.10, torch 2.1, DeepSpeed 0.13.1.

Python 3.10 is not installable here (Debian bookworm has 3.11; uv/pyenv fetch interpreters from GitHub or
python.org, which CI cannot reach) and DeepSpeed 0.13.1 cannot run on a CPU (its CPU accelerator needs
intel_extension_for_pytorch 2.1 and oneccl_bind_pt, neither on PyPI for CPython 3.11). So these checks are
static: the sources parse as Python 3.10 and use no newer standard-library names; no torch API newer than
2.1 is used unguarded; and every `deepspeed.*` name megatron_ds uses exists in DeepSpeed 0.13.1's own
source (the sdist, fetched by `make oldest-stack-sources`). `make test-torch21` runs the CPU training
tests for real on torch 2.1.2.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from .recipes import ROOT

SOURCES = sorted([*(ROOT / "megatron_ds").rglob("*.py"), ROOT / "entrypoint.py"])

# standard-library names added after Python 3.10 (module, or module.attribute)
NEWER_STDLIB = {
    "tomllib", "wsgiref.types", "typing.Self", "typing.LiteralString", "typing.Never", "typing.assert_never",
    "typing.assert_type", "typing.reveal_type", "typing.dataclass_transform", "typing.Required",
    "typing.NotRequired", "typing.TypeVarTuple", "typing.Unpack", "typing.override", "typing.TypeAliasType",
    "enum.StrEnum", "enum.verify", "enum.member", "enum.nonmember", "enum.global_enum", "datetime.UTC",
    "asyncio.TaskGroup", "asyncio.timeout", "asyncio.Runner", "contextlib.chdir", "hashlib.file_digest",
    "itertools.batched", "operator.call", "math.exp2", "math.cbrt", "logging.getLevelNamesMapping",
}
NEWER_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}
# torch names added after 2.1 (version that added them)
NEWER_TORCH = {
    "torch.nn.attention": "2.3", "torch.nn.RMSNorm": "2.4", "torch.nn.functional.rms_norm": "2.4",
    "torch.get_default_device": "2.3", "torch.library.custom_op": "2.4", "torch.library.register_fake": "2.4",
    "torch.amp.GradScaler": "2.3", "torch.distributed.device_mesh": "2.2", "torch.distributed.tensor": "2.4",
    "torch.distributed.checkpoint.state_dict": "2.2", "torch.compiler.is_compiling": "2.3",
    "torch.serialization.add_safe_globals": "2.4", "torch.serialization.safe_globals": "2.5",
    "torch.uint16": "2.3", "torch.uint32": "2.3", "torch.uint64": "2.3", "torch.float8_e4m3fnuz": "2.2",
    "torch.float8_e5m2fnuz": "2.2", "torch.nn.utils.parametrizations.weight_norm": "2.1",
    "torch.utils._pytree.tree_map_only_": "2.2", "torch.cuda.memory.MemPool": "2.5",
    "torch.distributed.breakpoint": "2.2", "torch.export": "2.1",
}
NEWER_TORCH = {k: v for k, v in NEWER_TORCH.items() if v > "2.1"}
NEWER_TORCH_KEYWORDS = {("scaled_dot_product_attention", "enable_gqa"): "2.5"}


def dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


class Uses(ast.NodeVisitor):
    """Every dotted name / import a module uses, with whether it sits behind a guard (try, hasattr,
    getattr or a version comparison), which is how code may use a newer API and still run on the old one."""

    def __init__(self):
        self.aliases: dict[str, str] = {}
        self.found: list[tuple[str, int, bool]] = []
        self.guards = 0

    def _guarded_test(self, test) -> bool:
        text = ast.unparse(test)
        return any(word in text for word in ("hasattr", "getattr", "version", "__version__"))

    def visit_Try(self, node):
        self.guards += 1
        for child in node.body:
            self.visit(child)
        self.guards -= 1
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    def visit_If(self, node):
        guarded = self._guarded_test(node.test)
        self.guards += guarded
        for child in node.body:
            self.visit(child)
        self.guards -= guarded
        for child in node.orelse:
            self.visit(child)

    def visit_IfExp(self, node):
        guarded = self._guarded_test(node.test)
        self.guards += guarded
        self.visit(node.body)
        self.guards -= guarded
        self.visit(node.orelse)

    def visit_Import(self, node):
        for alias in node.names:
            self.aliases[(alias.asname or alias.name).split(".")[0]] = (alias.name if alias.asname else
                                                                       alias.name.split(".")[0])
            self.found.append((alias.name, node.lineno, self.guards > 0))

    def visit_ImportFrom(self, node):
        if node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                self.aliases[alias.asname or alias.name] = full
                self.found.append((full, node.lineno, self.guards > 0))

    def visit_Attribute(self, node):
        name = dotted(node)
        if name:
            head, _, rest = name.partition(".")
            if head in self.aliases:
                self.found.append((self.aliases[head] + ("." + rest if rest else ""), node.lineno, self.guards > 0))
            return
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in NEWER_BUILTINS:
            self.found.append((node.id, node.lineno, self.guards > 0))

    def visit_Call(self, node):
        name = dotted(node.func) or ""
        for (function, keyword), version in NEWER_TORCH_KEYWORDS.items():
            if name.endswith(function) and any(k.arg == keyword for k in node.keywords):
                self.found.append((f"torch {function}({keyword}=) [{version}]", node.lineno, self.guards > 0))
        self.generic_visit(node)


def uses(path: Path) -> list[tuple[str, int, bool]]:
    visitor = Uses()
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found


def test_sources_parse_as_python_3_10():
    for path in SOURCES:
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))


def test_no_standard_library_name_newer_than_python_3_10():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in SOURCES for name, line, guarded in uses(p)
           if not guarded and (name in NEWER_STDLIB or name in NEWER_BUILTINS
                               or any(name.startswith(n + ".") for n in NEWER_STDLIB))]
    assert not bad, "newer than Python 3.10 (guard with try/except or sys.version_info):\n" + "\n".join(bad)


def test_no_unguarded_torch_api_newer_than_2_1():
    bad = []
    for path in SOURCES:
        for name, line, guarded in uses(path):
            hit = next((n for n in NEWER_TORCH if name == n or name.startswith(n + ".")), None)
            if (hit or name.startswith("torch ")) and not guarded:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name}"
                           + (f" (torch {NEWER_TORCH[hit]})" if hit else ""))
    assert not bad, "torch API newer than 2.1 used without a guard (hasattr/try/version check):\n" + "\n".join(bad)


# ------------------------------------------------------------------ DeepSpeed 0.13.1, by its own source

class ModuleIndex:
    """Names each module of a source tree defines at top level (defs, classes, assignments, imports,
    star imports followed), to check that `deepspeed.a.b` exists without importing (or running) it."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, set[str] | None] = {}

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def names(self, module: str) -> set[str] | None:
        if module in self.cache:
            return self.cache[module]
        self.cache[module] = set()
        path = self.path(module)
        if path is None:
            self.cache[module] = None
            return None
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: set[str] = set()
        for node in ast.parse(path.read_text(errors="replace")).body:
            self._collect(node, names, package)
        if path.name == "__init__.py":
            names |= ({p.stem for p in path.parent.glob("*.py")}
                      | {p.parent.name for p in path.parent.glob("*/__init__.py")})
        self.cache[module] = names
        return names

    def _collect(self, node, names, package):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if alias.name == "*":
                    names |= self.names(source) or set()
                else:
                    names.add(alias.asname or alias.name)
        elif isinstance(node, (ast.If, ast.Try)):
            for child in [*node.body, *getattr(node, "orelse", []), *getattr(node, "handlers", []),
                          *getattr(node, "finalbody", [])]:
                for grand in ([child] if not isinstance(child, ast.ExceptHandler) else child.body):
                    self._collect(grand, names, package)

    def resolves(self, dotted_name: str) -> bool:
        parts = dotted_name.split(".")
        module = parts[0]
        for i, part in enumerate(parts[1:], 1):
            names = self.names(module)
            if names is None:
                return False
            if part not in names:
                return False
            if self.path(f"{module}.{part}") is None:
                return True  # an object inside the module: its attributes are not indexed
            module = f"{module}.{part}"
        return self.names(module) is not None


def deepspeed_old_source() -> Path:
    source = os.environ.get("MDS_DEEPSPEED_OLD_SRC")
    candidates = [Path(source)] if source else sorted((ROOT / ".cache" / "oldest-stack").glob("deepspeed-0.13.1"))
    for candidate in candidates:
        if (candidate / "deepspeed" / "__init__.py").is_file():
            return candidate
    pytest.fail("DeepSpeed 0.13.1 source not at hand: `make oldest-stack-sources` fetches it (`make test` does), "
                "or MDS_DEEPSPEED_OLD_SRC=DIR names an unpacked sdist")


def test_deepspeed_names_exist_in_0_13_1():
    index = ModuleIndex(deepspeed_old_source())
    assert index.resolves("deepspeed.initialize") and not index.resolves("deepspeed.no_such_name_at_all")
    bad = []
    for path in SOURCES:
        for name, line, guarded in uses(path):
            if (name == "deepspeed" or name.startswith("deepspeed.")) and not guarded and not index.resolves(name):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bad, "not in DeepSpeed 0.13.1 (guard it, or use an API 0.13.1 has):\n" + "\n".join(bad)


def test_deepspeed_0_13_1_reduces_ulysses_gradients_over_our_groups():
    """Ulysses' attention is ours (parallel/mappings.py), so the MS-AMP image runs it too; what it needs of
    DeepSpeed 0.13.1 is that ZeRO reduces and partitions over DP x SP and sums over SP, as 0.19.8 does
    (the CPU tests' DeepSpeed; 0.13.1 itself runs only on GPUs). Its utils/groups.py reads the SP groups from our
    mpu only where ``hasattr(mpu, name)`` (otherwise it silently falls back to DP alone), so every such name
    must be a method of parallel/state.DeepSpeedMPU; ZeRO-1/2 divide by DP x SP / SP; stage 3's reduce-scatter
    path pre-divides by the whole group (what training/ulysses_zero.py's backward scale corrects); and
    zero.Init takes the arguments ulysses_zero passes."""
    import re

    from megatron_ds.parallel.state import DeepSpeedMPU

    root = deepspeed_old_source() / "deepspeed"
    groups = (root / "utils" / "groups.py").read_text()
    read = set(re.findall(r"hasattr\(mpu, '(get_sequence_\w+)'\)", groups))
    assert {"get_sequence_parallel_world_size", "get_sequence_data_parallel_group"} <= read, read
    assert not [name for name in read if not callable(getattr(DeepSpeedMPU, name, None))], read
    assert "/ float(self.sequence_parallel_size)" in (root / "runtime" / "zero" / "stage_1_and_2.py").read_text()
    assert "reduce_scatter_coalesced(full_grads_for_rank, self.dp_process_group)" in \
        (root / "runtime" / "zero" / "stage3.py").read_text()
    assert "tensor_partition_flat_buffer.div_(world_sz)" in \
        (root / "runtime" / "comm" / "coalesced_collectives.py").read_text()
    tree = ast.parse((root / "runtime" / "zero" / "partition_parameters.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Init")
    ctor = next(n for n in init.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert {"module", "data_parallel_group", "config_dict_or_path", "mpu"} <= {a.arg for a in ctor.args.args}
