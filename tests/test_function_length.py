"""No function in megatron_ds/ is longer than 80 lines: a longer one is split, or its table made data."""

import ast
import pathlib

import megatron_ds

LIMIT = 80


def long_functions(root: pathlib.Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines():
    root = pathlib.Path(megatron_ds.__file__).parent
    assert len(list(root.rglob("*.py"))) > 50  # the package itself, not an empty directory
    assert not long_functions(root), "\n".join(long_functions(root))


def test_the_walk_finds_a_long_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (package / "long.py").write_text(f"def short():\n    return 1\n\n\ndef too_long():\n{body}\n")
    assert long_functions(package) == [f"pkg/long.py:5 too_long ({LIMIT + 1} lines)"]
