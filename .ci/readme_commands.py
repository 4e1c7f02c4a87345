"""Prints the commands of a Markdown file's first code block, one per line.

``.ci/run`` runs what this prints, so that CI runs the README's commands as
written and the two cannot drift apart.
"""

import sys


def first_block_commands(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            if inside:
                return lines
            inside = True
        elif inside and line.strip():
            lines.append(line.strip())
    raise ValueError("no closed code block")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(first_block_commands(f.read())))
