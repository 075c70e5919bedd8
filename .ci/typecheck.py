"""Type-check lossplug under its import names, then the example plugin against an installed lossplug.

mypy derives a module's name from its folder, and lossplug's folders are not its package names (core/ is
``lossplug``, contracts/ is ``lossplug.contracts``, ...: pyproject's ``package-dir``). The editable install maps them
with an import hook, which a type checker does not run. So this lays out ``build/mypy/tree/lossplug`` as the
installed package would be — symlinks to the real files, remade on every run — and runs ``mypy`` (configured in
pyproject's ``[tool.mypy]``: ``packages = ["lossplug"]`` on that tree) with the error paths mapped back to the
checkout's files.

The example plugin is then checked with ``--strict``, as a plugin author's editor sees lossplug: by default against
the same tree; with ``--installed PYTHON``, against the lossplug installed (from a wheel, so through its
``py.typed``) in that interpreter's environment — CI passes its core-only install.

    python .ci/typecheck.py [--installed PYTHON]
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "mypy" / "tree"
EXAMPLE = ROOT / "examples" / "lossplug-example-plugin" / "lossplug_example_plugin"
#: where each part of the package lives in the checkout (pyproject's package-dir)
FOLDERS = {
    "lossplug": "core",
    "lossplug/contracts": "contracts",
    "lossplug/plugins": "plugins",
    "lossplug/adapters": "adapters",
}


def lay_out_tree() -> None:
    package = TREE / "lossplug"
    if package.exists():
        for link in package.iterdir():
            link.unlink()
    package.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "core").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in FOLDERS.items():
        if name != "lossplug":
            (TREE / name).symlink_to(ROOT / folder)


def to_checkout(line: str) -> str:
    """``build/mypy/tree/lossplug/contracts/batch.py:3: ...`` -> ``contracts/batch.py:3: ...``."""
    tree = f"{TREE.relative_to(ROOT)}/"
    if not line.startswith(tree):
        return line
    rest = line[len(tree) :]
    for name in sorted(FOLDERS, key=len, reverse=True):
        if rest.startswith(name + "/"):
            return FOLDERS[name] + rest[len(name) :]
    return line


def mypy(*args: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        print(to_checkout(line), flush=True)
    return out.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--installed",
        metavar="PYTHON",
        help="check the example against the lossplug installed in this interpreter's environment",
    )
    args = parser.parse_args()
    lay_out_tree()
    print("mypy: lossplug", flush=True)
    status = mypy()
    print("mypy --strict: the example plugin", flush=True)
    if args.installed:
        where, env = ["--python-executable", args.installed], None
    else:  # the tree stands in for an installed lossplug; its own errors are the run above's business
        where, env = ["--follow-imports", "silent"], {**os.environ, "MYPYPATH": str(TREE)}
    example = mypy(
        "--config-file",
        str(EXAMPLE.parent / "pyproject.toml"),
        "--cache-dir",
        str(TREE.parent / "cache"),
        *where,
        str(EXAMPLE.relative_to(ROOT)),
        env=env,
    )
    return status or example


if __name__ == "__main__":
    sys.exit(main())
