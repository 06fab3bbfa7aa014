"""Rewrite one source text: parse, run the stages in order, render the result."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Optional

import libcst as cst
from libcst.codemod import CodemodContext

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.report import InputError, RefusedError, RewriteResult
from .stage import ATTENTION_KEY, CHANGES_KEY, OPTIONS_KEY


def parse(source: bytes, path: str = "<input>") -> cst.Module:
    """Parse bytes (encoding from the coding cookie, newlines kept) or raise InputError."""
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as err:
        # Python's own parser names the line and the problem best; libcst's position
        # can point past it. Compiling is parsing only: nothing runs.
        try:
            compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as py_err:
            raise InputError(f"syntax error: {py_err.msg}", py_err.lineno or 0) from None
        except ValueError:
            pass
        raise InputError(f"syntax error: {err.message.splitlines()[0]}", err.raw_line) from None
    except (LookupError, UnicodeDecodeError, SyntaxError) as err:
        raise InputError(f"cannot decode the file: {err}") from None


def rewrite_source(source: bytes, path: str, options: Optional[RetrofitOptions] = None) -> RewriteResult:
    """Rewrite `source` (the bytes of the file at `path`) into FSDP2.

    Never raises for a script it cannot convert: the refusal is in the result and
    `code` is the original. Raises InputError for input that cannot be parsed.
    """
    from codemods.retrofit import RetrofitCommand
    from fsdp2_retrofit.analysis.model_classes import recording_reads

    options = options or RetrofitOptions()
    if not source.strip():
        raise InputError("empty file: nothing to retrofit")
    module = parse(source, path)
    context = CodemodContext(filename=path)
    context.scratch[OPTIONS_KEY] = options
    tracker = _LineTracker(module.code)
    command = RetrofitCommand(context, options)
    command.after_stage = tracker.wrap(command.after_stage)  # type: ignore[method-assign]
    try:
        with recording_reads() as looked_at:
            new_module = command.transform_module(module)
    except RefusedError as refused:
        refusal = dataclasses.replace(refused.refusal, line=tracker.to_original(refused.refusal.line))
        return RewriteResult(path, source, source, [], [], [refusal], sorted(looked_at))
    new_code = new_module.bytes
    _must_compile(new_module, path)
    return RewriteResult(
        path,
        source,
        new_code,
        sorted(tracker.mapped(context.scratch.get(CHANGES_KEY, [])), key=lambda c: c.line),
        sorted(tracker.mapped(context.scratch.get(ATTENTION_KEY, [])), key=lambda a: a.line),
        [],
        sorted(looked_at),
    )


def _must_compile(module: cst.Module, path: str) -> None:
    """A rewrite produces code that parses and compiles, or the pipeline is wrong."""
    compile(module.code, path, "exec")


class _LineTracker:
    """Maps the line numbers each stage reports (in the text it received) back to
    the user's original file, through the diffs between stages."""

    def __init__(self, original: str):
        self.original = original.splitlines()
        self.current = self.original
        self.records = []

    def wrap(self, after_stage):
        def hooked(stage, tree, context):
            mapping = self._mapping_to_original(self.current)
            for key in (CHANGES_KEY, ATTENTION_KEY):
                for rec in context.scratch.get(key, []):
                    self.records.append((id(rec), mapping(rec.line)))
            after_stage(stage, tree, context)
            self.current = tree.code.splitlines()

        return hooked

    def to_original(self, line: int) -> int:
        """A line of the text the current stage received, as a line of the original."""
        return self._mapping_to_original(self.current)(line) if line else line

    def _mapping_to_original(self, lines):
        matcher = difflib.SequenceMatcher(a=self.original, b=lines, autojunk=False)
        blocks = [(b + 1, b + n, a - b) for a, b, n in matcher.get_matching_blocks() if n]

        def to_original(line: int) -> int:
            for first, last, offset in blocks:
                if first <= line <= last:
                    return line + offset
            # an inserted line: the next original line after it
            for first, _last, offset in blocks:
                if first > line:
                    return first + offset
            return len(self.original)

        return to_original

    def mapped(self, records):
        lines = dict(self.records)
        return [dataclasses.replace(r, line=lines.get(id(r), r.line)) for r in records]
