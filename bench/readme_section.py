"""Write a benchmark's table between its markers in ``bench/README.md`` (the numbers are never typed)."""

from __future__ import annotations

import re
import time
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


def write_section(name: str, command: str, text: str, *, dated: bool = True,
                  path: Path = README) -> None:
    """Replace ``<!-- NAME:begin -->…<!-- NAME:end -->`` in ``path`` (default bench/README.md;
    appended if absent) with ``text``, headed by the command that made it."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    stamp = f" ({time.strftime('%Y-%m-%d')}, this 2-core machine)" if dated else ""
    body = f"{begin}\n`{command}`{stamp}:\n\n{text}{end}"
    old = path.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    path.write_text(pattern.sub(lambda _m: body, old) if pattern.search(old)
                      else old + "\n" + body + "\n")
