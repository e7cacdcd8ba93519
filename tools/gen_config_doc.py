"""Write the knob table of docs/configuration.md from ``Config``'s declarations.

Every knob is declared once in bpsctl/config.py (name, type, default, environment variable,
help); this writes them, one row each, between the markers below in docs/configuration.md and
leaves the rest of the page as it is. tests/test_docs.py fails when the page is not current.

    python tools/gen_config_doc.py           # rewrite the table
    python tools/gen_config_doc.py --check   # exit 1 if the page is not current
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN GENERATED: python tools/gen_config_doc.py -->"
END = "<!-- END GENERATED -->"
COMMAND = "python tools/gen_config_doc.py"

_KINDS = {"int": "integer", "float": "number", "str": "text", "bool": "0 or 1",
          "size": "size", "path": "path"}
_BINARY = [(1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")]


def _default(value: Any, kind: str) -> str:
    """A default as a user writes it, the same on every machine (``~`` for the home)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, Path):
        home = Path("~").expanduser()
        text = ("~/" + str(value.relative_to(home))) if value.is_relative_to(home) else str(value)
        return f"`{text}`"
    if kind == "size" and isinstance(value, int) and value:
        for scale, unit in _BINARY:
            if value % scale == 0:
                return f"{value} ({value // scale} {unit})"
        return str(value)
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    if value == "":
        return "empty"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table() -> str:
    """The generated part of the page: every knob of ``Config``, in declaration order."""
    sys.path.insert(0, str(REPO))
    from bpsctl.config import Config
    rows = ["| variable | knob (tuned file) | type | default | what it does |",
            "|---|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        meta = f.metadata
        names = " ".join(f"`{env}`" for env in (meta["env"], *meta["fallback_env"]))
        knob = f"`{f.name}`" + (" ✓" if meta["in_file"] else "")
        rows.append(f"| {names} | {knob} | {_KINDS[meta['kind']]} | "
                    f"{_default(f.default, meta['kind'])} | {_cell(meta['help'])} |")
    return "\n".join([BEGIN, *rows, END])


def render(page: str) -> str:
    """``page`` with its generated part replaced by the current table."""
    head, found, rest = page.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise SystemExit(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    return head + table() + tail


def main(argv: list[str]) -> int:
    current = PAGE.read_text()
    wanted = render(current)
    if "--check" in argv:
        if current != wanted:
            print(f"{PAGE.relative_to(REPO)} is not current: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        PAGE.write_text(wanted)
        print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
