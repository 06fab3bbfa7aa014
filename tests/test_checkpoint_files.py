"""checkpoint_files: a checkpoint saved or loaded through a file object takes the path,
or the file is refused (FSR705 save, FSR803 load) where the path cannot take its place.
The conversion itself is the fixture file_object_checkpoint (golden, and run by
test_execution / test_checkpoint)."""
from __future__ import annotations

import textwrap

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

TRAIN = """\
import io
import torch
import torch.nn as nn


def main():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{load}
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
{save}


if __name__ == "__main__":
    main()
"""


def _rewrite(load: str = "", save: str = ""):
    source = TRAIN.format(load=textwrap.indent(textwrap.dedent(load), "    "), save=textwrap.indent(textwrap.dedent(save), "    "))
    return rewrite_source(source.encode(), "train.py")


@pytest.mark.parametrize(
    "save, line, problem",
    [
        ('with open("m.pt", "wb") as f:\n    f.write(b"v1")\n    torch.save(model.state_dict(), f)\n', 16, "used for more"),
        ("buffer = io.BytesIO()\ntorch.save(model.state_dict(), buffer)\n", 15, "io.BytesIO()"),
        ('with open("m.pt", "ab") as f:\n    torch.save(model.state_dict(), f)\n', 15, "mode \"ab\""),
    ],
    ids=["other-writes", "bytesio", "append-mode"],
)
def test_a_save_to_a_file_object_that_cannot_be_a_path_is_refused(save, line, problem):
    result = _rewrite(save=save)
    assert [r.code for r in result.refusals] == ["FSR705"], result.refusals
    assert result.refusals[0].line == line and problem in result.refusals[0].what


def test_a_load_from_a_file_object_used_for_more_is_refused():
    result = _rewrite(load='with open("m.pt", "rb") as f:\n    model.load_state_dict(torch.load(f))\n    print(f.name)\n')
    assert [(r.code, r.line) for r in result.refusals] == [("FSR803", 10)]


def test_a_with_open_save_and_load_take_the_path():
    result = _rewrite(
        load='with open("m.pt", "rb") as f:\n    model.load_state_dict(torch.load(f))\n',
        save='with open("m.pt", "wb") as f:\n    torch.save(model.state_dict(), f)\n',
    )
    assert not result.refusals
    code = result.code.decode()
    assert "open(" not in code
    assert 'dcp.save(get_model_state_dict(model), checkpoint_id="m.pt")' in code
    assert 'dcp.load(state_dict, checkpoint_id="m.pt")' in code or 'torch.load("m.pt")' in code
    assert [c.line for c in result.changes if c.code == "checkpoint_files"] == [9, 16]
