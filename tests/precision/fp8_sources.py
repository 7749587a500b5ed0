"""Reading an upstream Python source tree statically (ast, no import): where a module's name is defined (following
its imports, relative ones too), what a function or class accepts, and which names a definition mentions.

Used by the checks that the Transformer Engine and MS-AMP names megatron_ds uses exist in the versions the images
pin: those libraries need CUDA and their compiled extensions, so they cannot be imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path


class SourceTree:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._trees: dict[Path, ast.Module] = {}

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(path.read_text(errors="replace"), str(path))
        return self._trees[path]

    def _top_level(self, module: str, name: str, seen: frozenset = frozenset()) -> ast.AST | None:
        """The class or function ``name`` of ``module``: defined there, or imported there (followed)."""
        path = self.module_file(module)
        if path is None or (module, name) in seen:
            return None
        seen = seen | {(module, name)}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        body = self.tree(path).body
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    source = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    if alias.name == "*":
                        found = self._top_level(source, name, seen)
                        if found is not None:
                            return found
                    elif (alias.asname or alias.name) == name:
                        found = self._top_level(source, alias.name, seen)
                        if found is None and self.module_file(f"{source}.{alias.name}"):
                            return self.tree(self.module_file(f"{source}.{alias.name}"))
                        return found
        return None

    def exported(self, module: str) -> set[str]:
        """Names a module binds at top level (definitions, imports, assignments), without following imports."""
        path = self.module_file(module)
        names: set[str] = set()
        if path is None:
            return names
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ImportFrom):
                names |= {alias.asname or alias.name for alias in node.names}
            elif isinstance(node, ast.Import):
                names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        for node in self.tree(path).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        return names

    def find(self, spec: str) -> ast.AST | None:
        """``module:Qualified.name`` -> the definition (a class, a function, a method or property of a class)."""
        module, _, qualname = spec.partition(":")
        head, *rest = qualname.split(".")
        node = self._top_level(module, head)
        for part in rest:
            if node is None:
                return None
            node = next((child for child in getattr(node, "body", [])
                         if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                         and child.name == part), None)
        return node


def accepted_names(node: ast.AST) -> set[str]:
    """A function's parameters; a class's __init__ parameters, annotated fields (dataclass) and members (enum)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        return {arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs}
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            names |= accepted_names(item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return names


def takes_any_keyword(node: ast.AST) -> bool:
    """The function (or class __init__) has **kwargs."""
    if isinstance(node, ast.ClassDef):
        init = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
        return init is not None and init.args.kwarg is not None
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.kwarg is not None


def mentions(node: ast.AST, name: str) -> bool:
    """``name`` occurs in the definition: as an attribute, a name, a nested definition, or a string constant."""
    for child in ast.walk(node):
        if ((isinstance(child, ast.Attribute) and child.attr == name)
                or (isinstance(child, ast.Name) and child.id == name)
                or (isinstance(child, (ast.FunctionDef, ast.ClassDef)) and child.name == name)
                or (isinstance(child, ast.Constant) and child.value == name)):
            return True
    return False
