"""Report lines are the user's: carried from the first parse through every stage's
edits (syntax.names.Origins), not guessed from a diff of the texts between stages."""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.rewrite.pipeline import rewrite_source

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
