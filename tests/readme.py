"""The README's code blocks, so tests can run its examples as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(language: str, section: str | None = None) -> list[str]:
    """The ```language blocks of README.md, of one `## section` only when given."""
    text = README.read_text()
    if section is not None:
        start = text.index(f"## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end >= 0 else None]
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def shell_commands(section: str | None = None) -> list[list[str]]:
    """Every command of the bash blocks (continuation lines joined, comments dropped), as argv lists;
    `a && b` gives a and b."""
    commands = []
    for block in code_blocks("bash", section):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv:
                    commands.append(argv)
    return commands
