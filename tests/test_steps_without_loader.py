"""An optimizer step no loop repeats (a one-off step at module level, or in a function
run once) takes its batch from no DataLoader the rewrite shards: the report flags it
with differs=True at the step's line, once; steps inside loops are the loops' business."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

ONE_STEP = '''
import torch
from torch import nn

x = torch.randn(10, 3)
y = torch.randn(10, 2)
linear = nn.Linear(3, 2)
optimizer = torch.optim.SGD(linear.parameters(), lr=0.01)
loss = nn.functional.mse_loss(linear(x), y)
loss.backward()
optimizer.step()
'''

FLAG = "steps outside any loop over a DataLoader"


def _flags(source: str):
    result = rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    return [a for a in result.attention if FLAG in a.what]


def _line_of(source: str, fragment: str) -> int:
    return next(i for i, line in enumerate(dedent(source).splitlines(), 1) if fragment in line)


def test_a_module_level_step_is_flagged_at_its_line_as_differing():
    flags = _flags(ONE_STEP)
    assert [(a.line, a.differs) for a in flags] == [(_line_of(ONE_STEP, "optimizer.step()"), True)]


def test_two_steps_are_flagged_once():
    source = ONE_STEP + "loss = nn.functional.mse_loss(linear(x), y)\nloss.backward()\noptimizer.step()\n"
    flags = _flags(source)
    assert len(flags) == 1 and "(and 1 more)" in flags[0].what


def test_a_step_in_a_function_run_once_is_flagged():
    source = ONE_STEP.replace("x = torch.randn", "def main():\n    x = torch.randn")
    source = source.replace("\ny = ", "\n    y = ").replace("\nlinear = ", "\n    linear = ").replace(
        "\noptimizer = ", "\n    optimizer = ").replace("\nloss = ", "\n    loss = ").replace(
        "\nloss.backward", "\n    loss.backward").replace("\noptimizer.step", "\n    optimizer.step")
    source += "\n\nif __name__ == '__main__':\n    main()\n"
    assert [a.line for a in _flags(source)] == [_line_of(source, "optimizer.step()")]


def test_steps_in_a_loop_or_a_helper_called_in_a_loop_are_not_flagged():
    looped = ONE_STEP.replace("loss = nn", "for _ in range(3):\n    loss = nn").replace(
        "\nloss.backward()\noptimizer.step()", "\n    loss.backward()\n    optimizer.step()")
    assert _flags(looped) == []
    helper = '''
import torch
from torch import nn
from torch.utils.data import DataLoader

linear = nn.Linear(3, 2)
optimizer = torch.optim.SGD(linear.parameters(), lr=0.01)


def train_step(x, y):
    nn.functional.mse_loss(linear(x), y).backward()
    optimizer.step()


def epoch(loader):
    for x, y in loader:
        train_step(x, y)


loader = DataLoader(data, batch_size=4)
for _ in range(2):
    epoch(loader)
'''
    assert _flags(helper) == []


def test_the_no_dataloader_loop_flag_is_not_repeated_for_its_steps():
    looped = ONE_STEP.replace("loss = nn", "for _ in range(3):\n    loss = nn").replace(
        "\nloss.backward()\noptimizer.step()", "\n    loss.backward()\n    optimizer.step()")
    result = rewrite_source(dedent(looped).encode(), "train.py", RetrofitOptions())
    differing = [a for a in result.attention if a.differs]
    assert len(differing) == 1 and "no DataLoader" in differing[0].what
