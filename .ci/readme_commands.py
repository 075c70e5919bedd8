"""Print the README's two commands — the first ```bash block of README.md, one command a line — for .ci/run.

    python .ci/readme_commands.py 1    # install and run the demo
    python .ci/readme_commands.py 2    # install and run the tests
    python .ci/readme_commands.py 2 --steps   # the same command split at ' && ', one step a line

CI runs what this prints, and nothing else before it, so a green CI means a newcomer's run of the README works.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def commands(text: str | None = None) -> list[str]:
    """The command lines of the README's first ``bash`` block (comments dropped)."""
    text = README.read_text(encoding="utf-8") if text is None else text
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    if block is None:
        raise SystemExit("README.md has no ```bash block")
    lines = [line.strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def main(argv: list[str]) -> None:
    found = commands()
    if len(found) != 2:
        raise SystemExit(f"README.md's first bash block must hold exactly two commands, found {len(found)}")
    command = found[int(argv[0]) - 1]
    print("\n".join(command.split(" && ")) if "--steps" in argv[1:] else command)


if __name__ == "__main__":
    main(sys.argv[1:])
