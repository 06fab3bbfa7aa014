"""Report lines are the user's: carried from the first parse through every stage's
edits (syntax.names.Origins), not guessed from a diff of the texts between stages."""
from __future__ import annotations

from pathlib import Path

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"


def rewrite(case: str):
    path = FIXTURES / case / "input.py"
    result = rewrite_source(path.read_bytes(), str(path))
    assert not result.refusals, result.refusals
    return path.read_text().splitlines(), result


def line_of(lines, text: str) -> int:
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_a_statement_an_earlier_stage_edited_keeps_its_line():
    # migrate_ddp rewrites `model.module.blocks` in the print and the `getattr(model,
    # "module", model)` in the save; rank_zero and checkpoint then report on them
    lines, result = rewrite("dataparallel")
    by_stage = {}
    for change in result.changes:
        by_stage.setdefault(change.code, set()).add(change.line)
    assert by_stage["rank_zero"] == {line_of(lines, 'print(f"epoch {epoch} loss')}
    assert by_stage["checkpoint"] == {line_of(lines, "torch.save(")}


def test_a_call_whose_arguments_an_earlier_stage_dropped_keeps_its_line():
    # migrate_spawn drops init_process_group's keywords; launch reports on that call
    lines, result = rewrite("mp_spawn")
    launch = [c for c in result.changes if c.code == "launch" and "reuse" in c.what]
    assert [c.line for c in launch] == [line_of(lines, "dist.init_process_group(")]


TRICKY = (
    "# header comment\n"
    "import torch\n"
    "\n"
    "x = torch.zeros(\n"
    "    3,\n"
    "    4)  # a call over three lines\n"
    "s = '''a\n"
    "b'''; t = s + \\\n"
    "    'c'\n"
    "def f(a,\n"
    "      b):\n"
    "    # a comment line\n"
    "\n"
    "    y = a(b); z = [\n"
    "        1, 2]\n"
    "    if y:\n"
    "        return f'{z}'\n"
    "    if y and \\\n"
    "            z:  # a continued header above the body\n"
    "        w = 1\n"
    "    while y and \\\n"
    "            not z: w = 2\n"
    "    if \\\n"
    "            y:  # the break is the `if`'s own whitespace\n"
    "        w = 3\n"
    "    return (y\n"
    "            + 1)\n"
    "f(x, s)\n"
)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_every_node_s_line_is_the_line_libcst_gives_it(newline):
    """Origins.line reads a one-line statement's line without resolving positions: it
    must agree with PositionProvider over the whole file for every node, on multi-line
    calls, strings, continuations, comments, `;` and CRLF files alike."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    from fsdp2_retrofit.syntax.names import Origins, Resolver, walk

    text = TRICKY.replace("\n", newline)
    module = cst.parse_module(text)
    origins = Origins(module, text)
    Resolver(module, origins)
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    checked = 0
    for node in (n for stmt in module.body for n in walk(stmt)):
        if node in positions:
            assert origins.line(node) == positions[node].start.line, (type(node).__name__, cst.Module([]).code_for_node(node))
            checked += 1
    assert checked > 100
