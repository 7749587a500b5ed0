"""The package's layers: every import in megatron_ds/ points down, and no modules import each other in a circle.

The layers, bottom first (a package may import from its own layer's modules and from the layers below it,
never from a layer above; packages that share a layer are independent and may not import each other):

  0  megatron_ds (the version), torch_support   what the installed torch can do
  1  runtime, data                              ranks, sites, launching; indexed datasets and tokenizers
  2  parallel                                   process groups and tensor-parallel building blocks
  3  model                                      the GPT, plain torch over our parallel layers
  4  precision, checkpoint                      bf16/fp16 and the FP8 engines around the model's GEMMs;
                                                checkpoint files: save/load, metadata, split records, shards
  5  training                                   flags and their rules, building a run, the loop
  6  convert                                    entrypoint convert: HF/Megatron-DeepSpeed in and out, reshard
  7  demo                                       make demo

Besides: runtime knows nothing of models, and model nothing of DeepSpeed.
Every import counts, a function-level (lazy) one as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, ...]] = [
    ("megatron_ds.image_flavours",),  # the image flavour table (standard library only)
    ("megatron_ds.env_settings", "megatron_ds.compile_costs"),  # the MDS_* variables; compile costs (torch only)
    ("megatron_ds", "megatron_ds.torch_support"),
    ("megatron_ds.runtime", "megatron_ds.data"),
    ("megatron_ds.parallel",),
    ("megatron_ds.model",),
    ("megatron_ds.precision",),
    ("megatron_ds.arguments",),  # flags -> Settings: what checkpoints record and compare, what training runs
    ("megatron_ds.checkpoint",),
    ("megatron_ds.training",),
    ("megatron_ds.convert",),
    ("megatron_ds.demo",),
]

# package -> third-party top-level modules it must not import
FORBIDDEN = {"megatron_ds.model": ("deepspeed",), "megatron_ds.parallel": ("deepspeed",)}


def modules(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module of ``package`` under ``root`` (a package is its __init__)."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in its file, and the top-level names of
    the others (third-party). ``from P import X`` names the module P.X where X is one, else P itself."""
    is_package = path.name == "__init__.py"
    out = set()

    def owner(dotted: str) -> str:  # the deepest known module that ``dotted`` is or lies in
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(owner(alias.name) or alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                target = f"{source}.{alias.name}"
                out.add(target if target in known else owner(source) or source.partition(".")[0])
    out.discard(name)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: the import circles."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str, layers: list[tuple[str, ...]]) -> tuple[int, str] | None:
    """(layer number, package) of the longest package in ``layers`` that holds ``module``."""
    best = None
    for number, packages in enumerate(layers):
        for package in packages:
            if module == package or module.startswith(package + "."):
                if best is None or len(package) > len(best[1]):
                    best = (number, package)
    return best


def layer_problems(graph: dict[str, set[str]], layers: list[tuple[str, ...]],
                   forbidden: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """Every import that points up a layer, sideways to another package of the same layer, or to a forbidden
    third-party module; and every module that no layer holds."""
    problems = []
    for module in sorted(graph):
        here = layer_of(module, layers)
        if here is None:
            problems.append(f"{module} lies in no layer: add its package to LAYERS")
            continue
        for target in sorted(graph[module]):
            if target not in graph:  # third-party
                banned = (forbidden or {}).get(here[1], ())
                if target in banned:
                    problems.append(f"{module} imports {target}: {here[1]} must know nothing of it")
                continue
            there = layer_of(target, layers)
            if there is None or there[1] == here[1]:
                continue
            if there[0] > here[0]:
                problems.append(f"{module} (layer {here[0]}, {here[1]}) imports {target} from the layer above "
                                f"it: {there[0]}, {there[1]}")
            elif there[0] == here[0]:
                problems.append(f"{module} imports {target}: {here[1]} and {there[1]} share layer {here[0]} "
                                "and must not import each other")
    return problems


# ------------------------------------------------------------------------------------------------ the package

def test_no_import_cycles_in_the_package():
    found = cycles(import_graph(ROOT, "megatron_ds"))
    assert found == [], "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_import_points_down_a_layer():
    problems = layer_problems(import_graph(ROOT, "megatron_ds"), LAYERS, FORBIDDEN)
    assert problems == [], "\n".join(problems)


def test_the_graph_sees_lazy_imports_and_all_the_layers():
    """Guards against a checker that reads nothing: the arrows the package is known to have are found, a
    function-level import among them, and every layer holds a module."""
    graph = import_graph(ROOT, "megatron_ds")
    assert "megatron_ds.checkpoint" in graph["megatron_ds.training.loop"]
    assert "megatron_ds.data.gpt_dataset" in graph["megatron_ds.training.data"]  # imported inside a function
    for packages in LAYERS:
        for package in packages:
            assert any(m == package or m.startswith(package + ".") for m in graph), package


# ------------------------------------------------------------------------------- the checker, on planted trees

def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


PLANTED_LAYERS = [("pkg.low",), ("pkg.high",)]


def test_checker_finds_a_planted_cycle_through_a_lazy_import(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from pkg.low import b\n",
        "pkg/low/b.py": "def f():\n    from pkg.low.c import g\n",
        "pkg/low/c.py": "from . import a\n",
        "pkg/low/d.py": "import pkg.low.a\n",
    })
    assert cycles(import_graph(root, "pkg")) == [["pkg.low.a", "pkg.low.b", "pkg.low.c"]]


def test_checker_finds_a_planted_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/store.py": "def load():\n    from pkg.high.loop import State\n",
        "pkg/high/__init__.py": "",
        "pkg/high/loop.py": "from pkg.low.store import load\nclass State: pass\n",
    })
    graph = import_graph(root, "pkg")
    assert cycles(graph) == [["pkg.high.loop", "pkg.low.store"]]
    problems = layer_problems(graph, [("pkg",), *PLANTED_LAYERS])
    assert len(problems) == 1 and "pkg.low.store (layer 1, pkg.low) imports pkg.high.loop" in problems[0]


def test_checker_finds_sideways_forbidden_and_unplaced_modules(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/x.py": "import deepspeed.pipe\nfrom pkg.b import y\n",
        "pkg/b/__init__.py": "",
        "pkg/b/y.py": "",
        "pkg/stray.py": "",
    })
    problems = layer_problems(import_graph(root, "pkg"), [("pkg",), ("pkg.a", "pkg.b")], {"pkg.a": ("deepspeed",)})
    assert problems == [
        "pkg.a.x imports deepspeed: pkg.a must know nothing of it",
        "pkg.a.x imports pkg.b.y: pkg.a and pkg.b share layer 1 and must not import each other",
    ]
    problems = layer_problems(import_graph(root, "pkg"), [("pkg.a", "pkg.b")])
    assert problems == ["pkg lies in no layer: add its package to LAYERS",
                        "pkg.a.x imports pkg.b.y: pkg.a and pkg.b share layer 0 and must not import each other",
                        "pkg.stray lies in no layer: add its package to LAYERS"]


@pytest.mark.parametrize("text, expected", [
    ("from pkg.a import x\n", {"pkg.a.x"}),          # a submodule by name
    ("from pkg.a import helper\n", {"pkg.a"}),       # a name in the package's __init__
    ("from pkg.a.x import helper\n", {"pkg.a.x"}),
    ("import pkg.a.x as ax\n", {"pkg.a.x"}),
    ("import os, torch.nn\n", {"os", "torch"}),      # third-party: the top-level name
])
def test_checker_resolves_import_forms(tmp_path, text, expected):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/a/__init__.py": "", "pkg/a/x.py": "",
                            "pkg/user.py": text})
    assert import_graph(root, "pkg")["pkg.user"] == expected
