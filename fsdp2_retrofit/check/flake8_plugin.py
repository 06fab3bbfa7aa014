"""flake8 plugin: the `check` rules as flake8 findings (prefix FSD), for editors that run flake8.

flake8 hands plugins an `ast` tree; the rules work on a libcst tree, so the plugin
asks for the file's lines and parses them itself. Selection and `# noqa` are
flake8's own here (its --select/--extend-ignore and noqa handling).
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

from fsdp2_retrofit import __version__


class Flake8Plugin:
    name = "fsdp2-retrofit"
    version = __version__

    def __init__(self, tree, lines: List[str], filename: str = "stdin"):
        self.lines = lines
        self.filename = filename

    def run(self) -> Iterator[Tuple[int, int, str, type]]:
        from .lint import lint_source
        from .rules import all_rules

        data = "".join(self.lines).encode("utf-8")
        # every rule: flake8 applies its own --select/--ignore to what we report
        result = lint_source(data, self.filename, all_rules())
        if result.error is not None:
            return  # flake8 reports syntax errors itself (E999)
        for f in result.findings:
            yield f.line, f.col - 1, f"{f.code} {f.message}", type(self)
