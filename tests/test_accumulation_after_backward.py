"""Gradient accumulation whose step condition is tested after backward() on a counter that
changes after it (`micro += 1; if micro % accum == 0:`): the condition set_requires_gradient_sync
and set_reshard_after_backward need before backward() is the test with those assignments
substituted (`(micro + 1) % accum == 0`), whatever the names, the spelling of the increment and
of the gate (`if ...: continue`), the function or the class it sits in (fixtures
accumulation_count_after_backward and accumulation_count_after_backward_sibling run it on 2 ranks).
A condition that cannot be computed before backward() is reported with the statement that
keeps it from being computed, and nothing is inserted."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst
import pytest

from fsdp2_retrofit.analysis.step_condition import before
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn


    def main():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        accum = 3
        micro = 0
        for x in torch.randn(12, 8, 4):
            loss = model(x).sum() / accum
            loss.backward()
    LOOP_END


    main()
    """)


def _rewrite(loop_end: str, script: str = SCRIPT):
    result = rewrite_source(script.replace("LOOP_END\n", loop_end).encode(), "train.py")
    assert not result.refusals, result.refusals
    return result


@pytest.mark.parametrize("loop_end, condition", [
    ("        micro += 1\n        if micro % accum == 0:\n            optimizer.step()\n            optimizer.zero_grad()\n",
     "(micro + 1) % accum == 0"),
    ("        micro = micro + 1\n        if micro % accum == 0:\n            optimizer.step()\n            optimizer.zero_grad()\n",
     "(micro + 1) % accum == 0"),
    ("        micro += 1\n        if micro == accum:\n            optimizer.step()\n            optimizer.zero_grad()\n"
     "            micro = 0\n", "(micro + 1) == accum"),
    ("        micro += 1\n        step_now = micro % accum == 0\n        print(micro, loss.item())\n"
     "        if step_now:\n            optimizer.step()\n            optimizer.zero_grad()\n", "(micro + 1) % accum == 0"),
    ("        micro += 1\n        if micro % accum != 0:\n            continue\n        optimizer.step()\n"
     "        optimizer.zero_grad()\n", "(micro + 1) % accum == 0"),
    ("        with torch.no_grad():\n            micro += 1\n        if micro % accum == 0:\n            optimizer.step()\n"
     "            optimizer.zero_grad()\n", None),
], ids=["augmented", "plain", "reset-in-gate", "flag-and-print", "skip-gate", "inside-with"])
def test_the_condition_is_computed_before_backward(loop_end, condition):
    result = _rewrite(loop_end)
    code = result.code.decode()
    if condition is None:  # assigned inside a `with`: it may not run as written; not guessed
        assert "set_requires_gradient_sync" not in code
        assert any("changes after backward()" in a.what and "inside `with torch.no_grad():`" in a.why
                   for a in result.attention), result.attention
        return
    assert (f"        model.set_requires_gradient_sync({condition})\n"
            f"        model.set_reshard_after_backward({condition})\n        loss.backward()\n") in code, code
    assert not [a for a in result.attention if a.code == "accumulation"], result.attention
    change = next(c for c in result.changes if c.code == "accumulation")
    assert "read before backward() as after `micro" in change.what


def test_renamed_in_a_helper_function_with_a_skip_gate_it_is_the_same():
    script = dedent("""\
        import torch
        import torch.nn as nn


        def run_epoch(net, batches, opt, every, seen):
            for inputs in batches:
                (net(inputs).sum() / every).backward()
                seen = seen + 1
                if seen % every:
                    continue
                opt.step()
                opt.zero_grad()
            return seen


        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        sgd = torch.optim.SGD(net.parameters(), lr=0.1)
        count = 0
        for epoch in range(2):
            count = run_epoch(net, torch.randn(6, 8, 4), sgd, 3, count)
        """)
    code = _rewrite("", script).code.decode()
    assert ("        net.set_requires_gradient_sync(not ((seen + 1) % every))\n"
            "        net.set_reshard_after_backward(not ((seen + 1) % every))\n"
            "        (net(inputs).sum() / every).backward()\n") in code, code


@pytest.mark.parametrize("loop_end, why", [
    ("        micro = next(counter)\n        if micro % accum == 0:\n            optimizer.step()\n",
     "`micro = next(counter)` gives `micro` a value that may differ when computed earlier"),
    ("        if loss.item() > 0:\n            micro += 1\n        if micro % accum == 0:\n            optimizer.step()\n",
     "`micro` is assigned inside `if loss.item() > 0:`"),
    ("        micro, seen = micro + 1, 0\n        if micro % accum == 0:\n            optimizer.step()\n",
     "`micro, seen = micro + 1, 0` changes `micro`"),
], ids=["a-call", "conditional", "unpacking"])
def test_a_condition_that_cannot_be_computed_before_backward_is_reported_with_the_statement(loop_end, why):
    result = _rewrite(loop_end)
    assert "set_requires_gradient_sync" not in result.code.decode()
    found = [a for a in result.attention if a.code == "accumulation"]
    assert len(found) == 1 and "changes after backward()" in found[0].what and why in found[0].why, found


@pytest.mark.parametrize("test, between, expected", [
    ("micro % accum == 0", "micro += 1\n", "(micro + 1) % accum == 0"),
    ("self.micro % self.accum == 0", "self.micro += 1\n", "(self.micro + 1) % self.accum == 0"),
    ("is_step", "step += 2 * k\nis_step = step % accum == 0\n", "(step + (2 * k)) % accum == 0"),
    ("(i + 1) % accum == 0", "total += loss.item()\nprint(i, total)\n", "(i + 1) % accum == 0"),
    ("len(buf) == k", "buf.append(x)\n", None),
    ("self.micro == k", "self.bump()\n", None),
    ("c['m'] % k == 0", "c['m'] += 1\n", None),
], ids=["augmented", "attribute", "flag", "untouched", "mutated", "method-of-owner", "subscript"])
def test_before_substitutes_only_what_it_can_compute_ahead(test, between, expected):
    ahead = before(cst.parse_expression(test), cst.parse_module(between).body)
    assert ahead.text == expected, ahead
    assert (ahead.why == "") == (expected is not None)
