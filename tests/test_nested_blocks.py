"""Blocks inside nested containers (issue 32 A): which modules become FSDP2 units when
each repeated block is itself a container.

An inner ModuleList/ModuleDict has no forward (fully_shard refuses one: "containers that
do not implement forward"; on older torch its hooks would simply never fire), and an inner
Sequential that forward takes apart never runs its own forward either: the units are the
children, the modules the forward calls. An inner Sequential that forward calls stays one
unit. The parity runs (fixtures nested_modulelist, nested_modulelist_sibling) show the
outputs train like the originals; these show which units they train with.
"""
from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

from fsdp2_retrofit.pipeline import rewrite_source
from rewrite_cases import FIXTURES

HEAD = '''\
import torch
import torch.nn as nn


class Attn(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


class FF(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self, dim=8, depth=2):
        super().__init__()
'''
TAIL = '''

def main():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


main()
'''


def _rewrite(init: str, forward: str):
    source = HEAD + textwrap.indent(textwrap.dedent(init), " " * 8) + "\n    def forward(self, x):\n" + \
        textwrap.indent(textwrap.dedent(forward), " " * 8) + TAIL
    return rewrite_source(source.encode(), "/tmp/nested_blocks_case.py")


def _shard_lines(result) -> str:
    code = result.code.decode()
    start = code.index("    model = Net()\n")
    return textwrap.dedent(code[start: code.index("    opt = ")])


INNER_LIST = "self.layers = nn.ModuleList([nn.ModuleList([Attn(dim), FF(dim)]) for _ in range(depth)])\n"
UNPACKED = "for attn, ff in self.layers:\n    x = attn(x) + x\n    x = ff(x) + x\nreturn x\n"


def test_inner_module_lists_unpacked_by_forward_shard_their_children():
    result = _rewrite(INNER_LIST, UNPACKED)
    assert not result.refusals
    assert _shard_lines(result) == (
        "model = Net()\n"
        "for layer in model.layers:\n"
        "    for block in layer:\n"
        "        fully_shard(block, mesh=mesh, reshard_after_forward=block is not model.layers[-1][-1])\n"
        "fully_shard(model, mesh=mesh)\n"
    )
    assert any("inner ModuleList of `model.layers` (Attn, FF)" in c.what for c in result.changes)


def test_appended_inner_module_lists_of_an_empty_list_are_found():
    init = "self.layers = nn.ModuleList([])\nfor _ in range(depth):\n" \
           "    self.layers.append(nn.ModuleList([Attn(dim), FF(dim)]))\n"
    assert "for block in layer:\n" in _shard_lines(_rewrite(init, UNPACKED))


def test_inner_module_dicts_shard_their_values():
    init = 'self.layers = nn.ModuleList([nn.ModuleDict({"attn": Attn(dim), "ff": FF(dim)}) for _ in range(depth)])\n'
    forward = 'for layer in self.layers:\n    x = layer["attn"](x) + x\n    x = layer["ff"](x) + x\nreturn x\n'
    lines = _shard_lines(_rewrite(init, forward))
    assert "for layer in model.layers:\n    for block in layer.values():\n        fully_shard(block, mesh=mesh)\n" in lines


def test_an_inner_sequential_forward_takes_apart_shards_its_children():
    init = "self.layers = nn.ModuleList([nn.Sequential(Attn(dim), FF(dim)) for _ in range(depth)])\n"
    assert "for block in layer:\n" in _shard_lines(_rewrite(init, UNPACKED))


def test_an_inner_sequential_forward_calls_is_one_unit():
    init = "self.layers = nn.ModuleList([nn.Sequential(Attn(dim), FF(dim)) for _ in range(depth)])\n"
    forward = "for layer in self.layers:\n    x = layer(x) + x\nreturn x\n"
    lines = _shard_lines(_rewrite(init, forward))
    assert "for layer in" not in lines
    assert re.search(r"for index, block in enumerate\(model.layers\):\n    fully_shard\(block,", lines)


def test_an_inner_sequential_also_read_another_way_shards_its_children():
    init = "self.layers = nn.ModuleList([nn.Sequential(Attn(dim), FF(dim)) for _ in range(depth)])\n"
    forward = "for layer in self.layers:\n    x = layer(x) + layer[0](x)\nreturn x\n"
    assert "for block in layer:\n" in _shard_lines(_rewrite(init, forward))


def test_three_levels_deep_is_not_read_and_no_container_is_sharded():
    init = "self.layers = nn.ModuleList([nn.ModuleList([nn.ModuleList([Attn(dim)]), FF(dim)]) for _ in range(depth)])\n"
    forward = "for inner, ff in self.layers:\n    x = inner[0](x) + ff(x)\nreturn x\n"
    result = _rewrite(init, forward)
    assert _shard_lines(result) == "model = Net()\nfully_shard(model, mesh=mesh)\n"
    assert any("no repeated blocks found in `model`" in a.what for a in result.attention)


def test_renamed_locals_give_the_same_units():
    renamed = "for first, second in self.layers:\n    x = first(x) + x\n    x = second(x) + x\nreturn x\n"
    assert _shard_lines(_rewrite(INNER_LIST, renamed)) == _shard_lines(_rewrite(INNER_LIST, UNPACKED))


torch = pytest.importorskip("torch", reason="runs the golden's shard statements on the fixture's model")


def _golden_units(case: str, model) -> list:
    """Run the golden's statements from the first shard loop to the root's fully_shard with a
    recorder for fully_shard."""
    lines = (FIXTURES / case / "expected.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("for layer in model.layers"))
    end = next(i for i, line in enumerate(lines) if line.strip() == "fully_shard(model, mesh=mesh)")
    units = []
    namespace = {"model": model, "mesh": None,
                 "fully_shard": lambda module, **kwargs: units.append((module, kwargs.get("reshard_after_forward")))}
    exec(textwrap.dedent("\n".join(lines[start: end + 1])), namespace)
    return units


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case, module", [("nested_modulelist", "input"), ("nested_modulelist_sibling", "vit")])
def test_the_units_are_the_modules_forward_calls(case, module):
    vit = _load(FIXTURES / case / f"{module}.py", f"_{case}_{module}")
    model = vit.ViT()
    called = set()
    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, args: called.add(mod))
    model(torch.randn(2, 9, 16))
    units = _golden_units(case, model)
    modules = [m for m, _ in units]
    assert modules[-1] is model
    blocks = modules[:-1]
    assert blocks == [child for layer in model.layers for child in layer]
    assert all(m in called for m in modules)  # every unit's forward (and so its hooks) runs
    assert not any(isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) for m in modules)
    # only the last module run keeps its gathered parameters after forward
    assert [keep for _, keep in units[:-1]] == [True] * (len(blocks) - 1) + [False]
