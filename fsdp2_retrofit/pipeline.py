"""Rewrite one source text: parse, run the stages in order, render the result."""
from __future__ import annotations

import os
from typing import Optional

import libcst as cst

from codemods.retrofit import RetrofitCommand
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.output_check import crashes_in_output
from fsdp2_retrofit.report import Attention, InputError, RefusedError, RewriteResult
from fsdp2_retrofit.rewrite.context import RewriteContext
from fsdp2_retrofit.rewrite.stage import ATTENTION_KEY, CHANGES_KEY, OPTIONS_KEY, ORIGINS_KEY
from fsdp2_retrofit.syntax.names import Origins


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
    """Rewrite `source` (the bytes of the file at `path`) into FSDP2, with the project modules it
    reaches (the program: rewrite/link.py).

    Never raises for a script it cannot convert: the refusal is in the result and
    `code` is the original. Raises InputError for input that cannot be parsed.
    """
    options = options or RetrofitOptions()
    if not source.strip():
        raise InputError("empty file: nothing to retrofit")
    module = parse(source, path)
    return _whole_program(source, path, options, module)


# refusals that say the analysis did not see the model, its optimizer or its trainer class: where the
# program's training step is in another module, the linked program is the truer account
_NOT_SEEN = ("FSR605", "FSR610", "FSR611", "FSR612")


def _whole_program(source: bytes, path: str, options: RetrofitOptions, module: cst.Module) -> RewriteResult:
    """The script rewritten, with the coverage rule: a training step the script reaches in another module
    is converted with the program linked into one analysis (rewrite/link.py), or the rewrite is refused at
    that step (FSR970); never "converted" with that loop left as it was. A program with such a step is
    linked first; the script alone is rewritten where it has none, or where the program cannot be linked.
    A program whose only sites elsewhere are DataLoaders a function of another module builds is linked too,
    so the sampler goes where the loader is built; where it cannot be, the script alone reports them."""
    from fsdp2_retrofit.analysis.program import Program, unreached_step
    from fsdp2_retrofit.rewrite import link

    program = Program.read(path, module, source) if b"import" in source else None
    steps = program.training_steps() if program is not None and program.modules else []
    # a DataLoader built by a function of another module gets its sampler there: in the linked program
    loaders = program.loader_modules() if program is not None and program.modules and not steps else []
    if not steps and not loaders:
        result = _rewrite_module(source, path, options, module)
        if program is not None and program.problems and not result.refusals:
            result.attention.append(Attention(
                1, "program", f"a module the script imports was not read: {program.problems[0]}",
                "a training loop there would keep its plain DataLoader, saves and logging; check it by hand",
                differs=True, path=path))
        return result
    linked = link.plan(path, source, module, program)
    why = linked if isinstance(linked, str) else "the program cannot be linked"
    linked_refusal = None
    if isinstance(linked, link.Linked):
        text = linked.text.encode(module.encoding)
        # the linked tree itself (the parse of its text would be the same tree: libcst round-trips); the
        # converted tree is taken apart as it is, not parsed again from its text
        trees: list = []
        inner = _rewrite_module(text, path, options, linked.module, trees)
        if inner.refusals:
            inputs = sorted(set(inner.inputs) | set(program.files))
            linked_refusal = RewriteResult(path, source, source, [], [], link.refusal_records(linked, inner), inputs)
        else:
            taken_apart = link.split(linked, inner, trees[0], source, other_scripts=not steps)
            if isinstance(taken_apart, RewriteResult):
                return taken_apart
            why = taken_apart
    if not steps and linked_refusal is not None:
        return linked_refusal  # a helper's DataLoader elsewhere: what stops the linked program
    result = _rewrite_module(source, path, options, module)
    if not steps:
        return result  # the entry alone, which reports the helpers' DataLoaders it leaves as they are
    if result.refusals and result.refusals[0].code not in _NOT_SEEN:
        return result
    if linked_refusal is not None:
        return linked_refusal  # what stops the program's conversion, at its own file and line
    if result.refusals and linked is None:
        return result
    # the entry alone said "no model here" (or converted): the step in the other module is the true blocker
    step = steps[0]
    shown = os.path.abspath(step.path) if os.path.isabs(path) else os.path.relpath(step.path)
    return RewriteResult(path, source, source, [], [], [unreached_step(step, shown, why)],
                         sorted(set(result.inputs) | set(program.files)))


def _rewrite_module(source: bytes, path: str, options: RetrofitOptions, module: cst.Module,
                    trees: Optional[list] = None) -> RewriteResult:
    """One module through the stages; the converted tree is appended to `trees` where given (the
    result's code is its text)."""
    from fsdp2_retrofit.analysis.model_classes import recording_reads

    context = RewriteContext(filename=path)
    context.scratch[OPTIONS_KEY] = options
    # every record names a line of `source`
    origins = context.scratch[ORIGINS_KEY] = Origins(module, source.decode(module.encoding, errors="replace"))
    command = RetrofitCommand(context, options)
    try:
        with recording_reads() as looked_at:
            new_module = command.transform_module(module)
    except RefusedError as refused:
        return RewriteResult(path, source, source, [], [], [refused.refusal], sorted(looked_at))
    new_text = origins.render(new_module)  # rendered once: the bytes and the compile check share it
    if trees is not None:
        trees.append(new_module)
    _must_compile(new_text, path)
    new_code = new_text.encode(new_module.encoding)
    attention = context.scratch.get(ATTENTION_KEY, []) + crashes_in_output(new_module, new_code, path, origins)
    return RewriteResult(
        path,
        source,
        new_code,
        sorted(context.scratch.get(CHANGES_KEY, []), key=lambda c: c.line),
        sorted(attention, key=lambda a: a.line),
        [],
        sorted(looked_at),
    )


def _must_compile(text: str, path: str) -> None:
    """A rewrite produces code that parses and compiles, or the pipeline is wrong."""
    compile(text, path, "exec", dont_inherit=True)
