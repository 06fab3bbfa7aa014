"""The zero_grad stage: `model.zero_grad()` between the forward and backward() clears
through the one optimizer that trains the whole model, or the file is refused (FSR950).
The execution proof is fixtures/rewrite/zero_grad_after_forward."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = Net()
'''
OPT = "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
LOOP = '''    for step in range(3):
        loss = model(torch.randn(8, 4)).sum()
        {clear}
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
'''


def rewrite(code: str):
    return rewrite_source(dedent(code).encode(), "train.py", RetrofitOptions())


def zero_grad_lines(result) -> list:
    return [line.strip() for line in result.code.decode().splitlines() if "zero_grad" in line]


def test_the_models_zero_grad_after_the_forward_clears_through_the_optimizer():
    code = HEAD + OPT + LOOP.format(clear="model.zero_grad(set_to_none=True)")
    result = rewrite(code)
    assert not result.refusals, result.refusals
    assert zero_grad_lines(result) == ["opt.zero_grad(set_to_none=True)"]
    change = next(c for c in result.changes if c.code == "zero_grad")
    assert change.line == dedent(code).splitlines().index("        model.zero_grad(set_to_none=True)") + 1 and "`opt.zero_grad()`" in change.what and "gathered" in change.why


@pytest.mark.parametrize("clear", ["opt.zero_grad()", "pass"])
def test_nothing_changes_without_the_models_zero_grad_in_between(clear):
    result = rewrite(HEAD + OPT + LOOP.format(clear=clear))
    assert not result.refusals and not [c for c in result.changes if c.code == "zero_grad"]


def test_the_models_zero_grad_before_the_forward_is_left():
    loop = LOOP.replace("        loss = model", "        model.zero_grad()\n        loss = model").format(clear="pass")
    result = rewrite(HEAD + OPT + loop)
    assert not result.refusals
    assert zero_grad_lines(result) == ["model.zero_grad()"]


def test_a_nested_step_function_and_a_forward_through_a_helper():
    code = HEAD.replace("def main():", "def loss_of(net, x):\n    return net(x).sum()\n\n\ndef main():") + OPT + '''
    def step(x):
        loss = loss_of(model, x)
        model.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step(torch.randn(8, 4))


if __name__ == "__main__":
    main()
'''
    result = rewrite(code)
    assert not result.refusals, result.refusals
    assert zero_grad_lines(result) == ["opt.zero_grad()"]


@pytest.mark.parametrize(
    "opts, why",
    [
        (OPT + "    opt2 = torch.optim.SGD(model.parameters(), lr=0.2)\n", "2 optimizers may train it here (opt, opt2)"),
        ("    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)\n", "`opt` is built over part of the model"),
    ],
    ids=["two-optimizers", "part-of-the-model"],
)
def test_no_one_optimizer_over_the_whole_model_is_refused(opts, why):
    code = HEAD + opts + LOOP.format(clear="model.zero_grad()")
    result = rewrite(code)
    assert result.refusals and result.refusals[0].code == "FSR950", result.refusals
    refusal = result.refusals[0]
    line = dedent(code).splitlines().index("        model.zero_grad()") + 1
    assert refusal.line == line
    assert refusal.what.startswith("`model.zero_grad()` between the forward")
    assert refusal.why.startswith(why), refusal.why
    assert result.code == dedent(code).encode()


TWO = '''
import torch
from torch import nn


def main():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    dec = nn.Linear(4, 2)
    params = list(enc.parameters()) + list({dec_params}.parameters())
    opt = torch.optim.Adam(params, lr=0.1)
    for step in range(3):
        loss = dec(enc(torch.randn(8, 4))).sum()
        {clear}
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
'''


def test_zero_grads_of_every_model_one_optimizer_trains_clear_through_it():
    code = TWO.format(dec_params="dec", clear="enc.zero_grad()\n        dec.zero_grad()")
    result = rewrite(code)
    assert not result.refusals, result.refusals
    assert zero_grad_lines(result) == ["opt.zero_grad()"]
    change = next(c for c in result.changes if c.code == "zero_grad")
    assert change.line == dedent(code).splitlines().index("        enc.zero_grad()") + 1
    assert "`enc.zero_grad()` + `dec.zero_grad()` -> `opt.zero_grad()`" in change.what


@pytest.mark.parametrize(
    "dec_params, clear",
    [
        ("dec", "enc.zero_grad()"),  # dec's gradients: the original keeps them, opt.zero_grad() would clear them
        ("dec", "enc.zero_grad(); dec.zero_grad()"),  # one line: not two statements to merge
    ],
    ids=["one-of-two", "one-line"],
)
def test_zero_grads_that_do_not_clear_exactly_what_the_optimizer_trains_are_refused(dec_params, clear):
    code = TWO.format(dec_params=dec_params, clear=clear)
    result = rewrite(code)
    assert result.refusals and result.refusals[0].code == "FSR950", (result.refusals, result.changes)
    assert result.code == dedent(code).encode()


@pytest.mark.parametrize("part", ["enc[0]", "enc.head"])
def test_part_of_a_model_in_the_shared_optimizer_is_refused(part):
    code = TWO.replace("list(enc.parameters())", f"list({part}.parameters())").format(
        dec_params="dec", clear="enc.zero_grad()\n        dec.zero_grad()")
    result = rewrite(code)
    assert result.refusals and result.refusals[0].code == "FSR950", (result.refusals, result.changes)
