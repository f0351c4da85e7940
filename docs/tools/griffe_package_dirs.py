"""A griffe extension for the API reference: mtpflow installs some folders under its namespace through
setuptools' ``package-dir`` mapping (``mtpflow.strategies`` -> ``strategies/``, ``mtpflow.kernels`` ->
``kernels/``), which griffe's static finder does not follow. When it loads the ``mtpflow`` package, this
extension reads the mapping from ``pyproject.toml``, loads each mapped folder that holds Python code and
attaches it as the submodule, so ``::: mtpflow.strategies.pld`` resolves without importing anything."""
from __future__ import annotations

import sys
from pathlib import Path

import griffe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def package_dirs(root: Path, package: str) -> dict[str, Path]:
    """``{submodule name: folder}`` for the direct subpackages of ``package`` mapped outside its folder."""
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    found = {}
    for name, folder in mapping.items():
        parent, _, child = name.rpartition(".")
        path = (root / folder).resolve()
        if parent == package and path != (root / package / child).resolve() and (path / "__init__.py").exists():
            found[child] = path
    return found


class PackageDirs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "mtpflow" or pkg.filepath is None:
            return
        package_folder = Path(pkg.filepath if isinstance(pkg.filepath, Path) else pkg.filepath[0]).parent
        root = package_folder.parent
        if not (root / "pyproject.toml").exists():
            return
        for child, folder in package_dirs(root, "mtpflow").items():
            if child in pkg.members:
                continue
            module = loader.load(folder, submodules=True, try_relative_path=True)
            pkg.set_member(child, module)
