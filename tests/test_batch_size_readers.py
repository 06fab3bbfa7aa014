"""--keep-global-batch and a batch size the script reads elsewhere: a name (or attribute)
that also sizes batch tensors is rebound once to the per-rank size before the DataLoader,
or the file is refused (FSR903) naming the read that makes it unsafe."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst

from fsdp2_retrofit.analysis.batch_size import batch_size_readers
from fsdp2_retrofit.analysis.loops import train_loops
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import Resolver

HEAD = '''
import torch
from torch import nn
from torch.utils.data import DataLoader

'''

MODULE_LEVEL = HEAD + '''
batch_size = 8
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(data, batch_size=batch_size, shuffle=True)
for x in loader:
    x = x.reshape(batch_size, -1)
    target = torch.ones(batch_size, 1)
    nn.functional.mse_loss(model(x), target).backward()
    opt.step()
'''


def _rewrite(source: str, keep: bool = True):
    return rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions(keep_global_batch=keep))


def _line_of(source: str, fragment: str) -> int:
    return next(i for i, line in enumerate(dedent(source).splitlines(), 1) if fragment in line)


def _readers(source: str):
    module = cst.parse_module(dedent(source))
    resolver = Resolver(module)
    stmt = next(s for s in resolver.nodes(cst.SimpleStatementLine) if "DataLoader(" in module.code_for_node(s))
    call = stmt.body[0].value
    size = next(a.value for a in call.args if a.keyword is not None and a.keyword.value == "batch_size")
    return batch_size_readers(resolver, stmt, size, [loop.node for loop in train_loops(module, resolver)])


def test_shape_reads_are_told_from_other_reads():
    in_loop = "    full = torch.full((batch_size, 2), 0.5)\n    idx = torch.randint(0, batch_size, (4,))\n"
    readers = _readers(MODULE_LEVEL.replace("    opt.step()\n", "    opt.step()\n" + in_loop)
                       + "print(batch_size)\nsteps = len(data) // batch_size\nsample = torch.randn(batch_size, 4)\n")
    assert readers.key == "batch_size"
    assert len(readers.shape) == 3  # reshape, torch.ones, torch.full's size tuple: in the training loop
    assert len(readers.printed) == 1
    assert [what for _, what in readers.other] == [
        "an argument of `torch.randint(...)`",  # randint's high bound is no dimension
        "arithmetic: `len(data) // batch_size`",
        "a tensor sized outside the training loop",  # samples drawn for a picture, say
    ]


def test_a_name_read_by_batch_tensors_is_rebound_once_before_the_loader():
    result = _rewrite(MODULE_LEVEL)
    assert not result.refusals, result.refusals
    text = result.code.decode()
    assert ('assert batch_size % world_size == 0, "the batch size must divide by the number of ranks"\n'
            "batch_size = batch_size // world_size  # per rank from here on\n") in text
    assert "loader = DataLoader(data, batch_size=batch_size, sampler=sampler)\n" in text
    assert text.count("batch_size // world_size") == 1  # not divided twice
    assert any("`batch_size` is rebound to the per-rank size" in c.what for c in result.changes)
    assert "batch_size // world_size" not in _rewrite(MODULE_LEVEL, keep=False).code.decode()


def test_an_args_attribute_is_rebound_in_the_function_that_builds_the_loader():
    source = HEAD + '''
def main(args):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=args.batch_size)
    for x in loader:
        noise = torch.randn(args.batch_size, 4)
        model(x + noise).sum().backward()
        opt.step()
'''
    text = _rewrite(source).code.decode()
    assert "    args.batch_size = args.batch_size // world_size  # per rank from here on\n" in text
    assert "loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)" in text


def test_a_name_without_other_reads_is_divided_in_the_call_as_before():
    source = MODULE_LEVEL.replace("x.reshape(batch_size, -1)", "x").replace("torch.ones(batch_size, 1)", "x")
    text = _rewrite(source).code.decode()
    assert "batch_size=batch_size // world_size, sampler=sampler" in text
    assert "batch_size = batch_size // world_size" not in text


def test_a_count_read_beside_the_batch_tensors_is_refused_at_its_line():
    source = MODULE_LEVEL + "samples = len(loader) * batch_size\n"
    result = _rewrite(source)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR903", _line_of(source, "samples = "))]
    assert "global batch size or the per-rank one" in result.refusals[0].what


def test_a_name_bound_twice_is_refused():
    source = MODULE_LEVEL.replace("batch_size = 8\n", "batch_size = 8\nbatch_size = 16\n")
    result = _rewrite(source)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR903", _line_of(source, "batch_size = 16"))]
    assert "bound 2 times" in result.refusals[0].what


def test_a_module_constant_read_by_a_loader_in_a_function_is_refused():
    source = HEAD + '''
batch_size = 8


def main():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=batch_size)
    for x in loader:
        model(x.view(batch_size, -1)).sum().backward()
        opt.step()
'''
    result = _rewrite(source)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR903", _line_of(source, "batch_size = 8"))]
    assert "would make it a local name" in result.refusals[0].what


def test_a_tensor_sized_outside_the_training_loop_is_refused_beside_batch_tensors():
    source = MODULE_LEVEL.replace("model = nn.Linear(4, 1)\n", "model = nn.Linear(4, 1)\nfixed = torch.zeros(batch_size, 4)\n")
    result = _rewrite(source)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR903", _line_of(source, "fixed = "))]


def test_a_loader_built_in_a_loop_is_refused():
    source = MODULE_LEVEL.replace("loader = DataLoader(data, batch_size=batch_size, shuffle=True)\nfor x in loader:",
                                  "for epoch in range(2):\n  loader = DataLoader(data, batch_size=batch_size, shuffle=True)\n  for x in loader:")
    source = source.replace("\n    ", "\n      ")
    result = _rewrite(source)
    assert [r.code for r in result.refusals] == ["FSR903"]
    assert "inside a loop" in result.refusals[0].what


def test_a_tensor_sized_outside_the_loop_alone_keeps_the_division_in_the_call():
    source = MODULE_LEVEL.replace("x.reshape(batch_size, -1)", "x").replace("torch.ones(batch_size, 1)", "x")
    source += "sample = torch.randn(batch_size, 4)\n"
    text = _rewrite(source).code.decode()
    assert "batch_size=batch_size // world_size, sampler=sampler" in text
    assert "sample = torch.randn(batch_size, 4)" in text


# --- issue 44 class 2: the shapes the rebinding missed -----------------------------------------


def test_legacy_constructors_and_arange_size_batch_tensors():
    in_loop = ("    a = torch.FloatTensor(batch_size, 1)\n    b = torch.cuda.LongTensor(batch_size)\n"
               "    c = torch.arange(batch_size)\n    d = torch.arange(end=batch_size)\n"
               "    e = torch.Tensor([batch_size])\n    f = torch.arange(0, batch_size, 2)\n")
    readers = _readers(MODULE_LEVEL.replace("    opt.step()\n", "    opt.step()\n" + in_loop))
    assert len(readers.shape) == 6  # reshape, ones, FloatTensor, LongTensor, arange(n), arange(end=n)
    assert [what for _, what in readers.other] == [
        "`e = torch.Tensor([batch_size])`",  # a list: data, not a size
        "an argument of `torch.arange(...)`",  # a range with a start and a step: not n elements
    ]


def test_a_buffer_preallocated_outside_the_loop_and_filled_in_it_is_a_batch_tensor():
    source = MODULE_LEVEL.replace("for x in loader:\n", "label = torch.FloatTensor(batch_size, 1)\n"
                                  "idx = torch.arange(batch_size).to('cpu')\nfor x in loader:\n    label.fill_(1)\n"
                                  "    x = x[idx]\n")
    readers = _readers(source)
    assert len(readers.shape) == 4 and not readers.other and readers.problem is None
    result = _rewrite(source)
    assert not result.refusals, result.refusals
    text = result.code.decode()
    assert text.index("batch_size = batch_size // world_size") < text.index("label = torch.FloatTensor(batch_size, 1)")


def test_a_random_draw_sized_outside_the_loop_stays_refused():
    """Drawn once at the per-rank size, it would take less of the random stream than the single
    run: every later draw would differ. Read in the loop or not, it stays an `other` read."""
    source = MODULE_LEVEL.replace("for x in loader:\n", "noise = torch.randn(batch_size, 4)\nfor x in loader:\n"
                                  "    x = x + noise\n")
    result = _rewrite(source)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR903", _line_of(source, "noise = "))]


def test_a_buffer_above_the_loader_moves_the_rebinding_up_to_it():
    source = HEAD + '''
def main(args):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = torch.ones(args.bs, 1)
    loader = DataLoader(data, batch_size=args.bs, shuffle=True)
    for x in loader:
        nn.functional.mse_loss(model(x.reshape(args.bs, -1)), target).backward()
        opt.step()
'''
    result = _rewrite(source)
    assert not result.refusals, result.refusals
    text = result.code.decode()
    rebind = ('    assert args.bs % world_size == 0, "the batch size must divide by the number of ranks"\n'
              "    args.bs = args.bs // world_size  # per rank from here on\n"
              '    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n'  # device_placement: it meets
              "    target = torch.ones(args.bs, 1, device=device)\n")  # the outputs, on the rank's device
    assert rebind in text, text
    assert text.count("args.bs // world_size") == 1 and text.count("args.bs % world_size") == 1
    assert "loader = DataLoader(data, batch_size=args.bs, sampler=sampler)" in text
    assert any("before its first batch tensor" in c.what for c in result.changes)


def test_a_buffer_above_the_loader_in_an_if_moves_the_rebinding_above_the_if():
    source = HEAD + '''
def main(args):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.smooth:
        target = torch.full((args.bs, 1), 0.9)
    else:
        target = torch.ones(args.bs, 1)
    loader = DataLoader(data, batch_size=args.bs, shuffle=True)
    for x in loader:
        nn.functional.mse_loss(model(x), target).backward()
        opt.step()
'''
    result = _rewrite(source)
    assert not result.refusals, result.refusals  # the `if` statement is in the loader's block: rebound above it
    text = result.code.decode()
    assert text.index("args.bs = args.bs // world_size") < text.index("if args.smooth:")
