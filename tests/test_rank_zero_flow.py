"""Values computed from a name bound only on rank 0 (issue 27): followed through
assignments, unpacking and a function's arguments to the save that reads them, by
the rewrite (broadcast, or FSR704 naming the chain) and by the check (FSD116)."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import analyse
from fsdp2_retrofit.analysis.checkpoints import rank_zero_names
from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''\
import os

import torch
import torch.nn as nn


def save_checkpoint(model, where):
    path = os.path.join(where, "m.pt")
    torch.save(model.state_dict(), path)


def main():
    rank = int(os.environ.get("RANK", 0))
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{gate}
    for step in range(3):
        loss = model(torch.randn(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
{tail}


if __name__ == "__main__":
    main()
'''
GATE = "    if rank == 0:\n        run_dir = make_run_dir()"


def _script(tail: str, gate: str = GATE) -> str:
    return SCRIPT.format(gate=gate, tail=tail)


def _line_of(source: str, fragment: str) -> int:
    return next(n for n, line in enumerate(source.splitlines(), 1) if fragment in line)


def _reads(source: str):
    facts = analyse(cst.parse_module(source))
    saves = [s for s in facts.resolver.nodes(cst.SimpleStatementLine) if "torch.save" in facts.module.code_for_node(s)]
    return [(r.name, [name for name, _ in r.chain]) for save in saves for r in rank_zero_names(save, facts)]


# -- the analysis -------------------------------------------------------------------

def test_a_path_made_from_the_name_in_an_f_string_leads_back_to_it():
    source = _script('    path = f"{run_dir}/model.pt"\n    torch.save(model.state_dict(), path)')
    assert _reads(source) == [("run_dir", ["path"])]


def test_a_chain_of_assignments_leads_back_to_it():
    source = _script('    path = os.path.join(run_dir, "m.pt")\n    p2 = path\n    torch.save(model.state_dict(), p2)')
    assert _reads(source) == [("run_dir", ["p2", "path"])]


def test_tuple_unpacking_leads_back_to_it():
    source = _script('    path, n = os.path.join(run_dir, "m.pt"), 3\n    torch.save(model.state_dict(), path)')
    assert _reads(source) == [("run_dir", ["path"])]


def test_a_parameter_leads_back_to_the_argument_of_each_call():
    source = _script('    ckpt = run_dir + "/ckpt"\n    save_checkpoint(model, ckpt)')
    assert _reads(source) == [("run_dir", ["path", "where", "ckpt"])]


def test_a_value_the_other_ranks_bind_to_their_own_leads_back_to_it_with_that_binding():
    """`run_dir = None` on every rank, then rank 0's own under `if rank == 0:`: the save, now on every rank,
    needs rank 0's value (each rank's own would split the checkpoint over two folders)."""
    gate = "    run_dir = None\n" + GATE
    source = _script('    path = f"{run_dir}/model.pt"\n    torch.save(model.state_dict(), path)', gate)
    assert _reads(source) == [("run_dir", ["path"])]
    facts = analyse(cst.parse_module(source))
    save = [s for s in facts.resolver.nodes(cst.SimpleStatementLine) if "torch.save" in facts.module.code_for_node(s)][-1]
    assert facts.resolver.line(rank_zero_names(save, facts)[0].otherwise) == _line_of(source, "run_dir = None")
    result = rewrite_source(source.encode(), "train.py")
    assert result.refusals == []
    code = result.code.decode()
    assert code.index("run_dir = run_dir_shared[0]") < code.index('path = f"{run_dir}/model.pt"')


# -- the rewrite: converted ----------------------------------------------------------

def test_the_name_behind_the_chain_is_broadcast_before_the_first_value_read_from_it():
    source = _script('    path = os.path.join(run_dir, "m.pt")\n    p2 = path\n    torch.save(model.state_dict(), p2)')
    result = rewrite_source(source.encode(), "train.py")
    assert result.refusals == []
    code = result.code.decode()
    assert "    dist.broadcast_object_list(run_dir_shared, src=0)" in code
    assert code.index("run_dir = run_dir_shared[0]") < code.index("path = os.path.join(run_dir")
    assert rewrite_source(result.code, "train.py").changes == []  # a second rewrite adds nothing


def test_a_save_split_out_of_its_own_rank_gate_reads_the_broadcast_name():
    # the second `if rank == 0:` is split: `path = ...` runs on every rank after the rewrite
    tail = '    if rank == 0:\n        path = f"{run_dir}/model.pt"\n        torch.save(model.state_dict(), path)'
    result = rewrite_source(_script(tail).encode(), "train.py")
    assert result.refusals == []
    code = result.code.decode()
    assert code.index("run_dir = run_dir_shared[0]") < code.index('    path = f"{run_dir}/model.pt"')


# -- the rewrite: refused ------------------------------------------------------------

def test_a_chain_from_a_gate_some_ranks_may_skip_is_refused_naming_every_link():
    gate = "    if os.environ.get(\"SAVE\"):\n        if rank == 0:\n            run_dir = make_run_dir()"
    source = _script('    path = os.path.join(run_dir, "m.pt")\n    p2 = path\n    torch.save(model.state_dict(), p2)',
                     gate)
    result = rewrite_source(source.encode(), "train.py")
    assert [(r.code, r.line) for r in result.refusals] == [("FSR704", _line_of(source, "if rank == 0:"))]
    what = result.refusals[0].what
    assert (
        f"`p2` (line {_line_of(source, 'p2 = path')}), which reads `path` (line {_line_of(source, 'path = os.path.join(run_dir')}), "
        f"which reads `run_dir`, bound only on rank 0 at line {_line_of(source, 'run_dir = make')}"
    ) in what
    assert f"the save on line {_line_of(source, 'torch.save(model.state_dict(), p2)')}" in what
    assert (f"the `if` is inside `if os.environ.get(\"SAVE\")` (line {_line_of(source, 'if os.environ')}), "
            "which some ranks may skip") in result.refusals[0].why


def test_a_chain_from_a_gate_with_an_else_or_nested_in_another_block_is_broadcast():
    """An `else` that binds nothing, a `with` around the gate: every rank reaches the `if` together, and
    rank 0's value is broadcast right after it, in its block (both were refused FSR704)."""
    for gate, indent in (("    if rank == 0:\n        run_dir = make_run_dir()\n    else:\n        print('waiting')", "    "),
                         ("    with torch.no_grad():\n        if rank == 0:\n            run_dir = make_run_dir()",
                          "        ")):
        source = _script('    save_checkpoint(model, run_dir)', gate)
        result = rewrite_source(source.encode(), "train.py")
        assert result.refusals == [], result.refusals
        code = result.code.decode()
        assert f"\n{indent}dist.broadcast_object_list(run_dir_shared, src=0)" in code
        assert code.index("run_dir = run_dir_shared[0]") < code.index("save_checkpoint(model, run_dir)")


# -- the check ------------------------------------------------------------------------

CHECKED = '''\
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard


def save_checkpoint(model, where):
    path = os.path.join(where, "m")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)


def main(model):
    fully_shard(model)
    if dist.get_rank() == 0:
        run_dir = make_run_dir()
{tail}
'''


def _findings(tail: str):
    source = CHECKED.replace("{tail}", tail)
    return source, [(f.code, f.line, f.message) for f in lint_source(source.encode(), "train.py", all_rules()).findings]


def test_the_check_follows_an_intermediate_to_the_rank_zero_name():
    source, found = _findings('    ckpt = f"{run_dir}/ckpt"\n    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)')
    assert [(c, line) for c, line, _ in found] == [("FSD116", _line_of(source, "checkpoint_id=ckpt"))]
    assert f"`ckpt` (line {_line_of(source, 'ckpt = f')}), which reads `run_dir`" in found[0][2]


def test_the_check_follows_a_parameter_to_the_caller():
    source, found = _findings("    save_checkpoint(model, run_dir)")
    assert [(c, line) for c, line, _ in found] == [("FSD116", _line_of(source, "checkpoint_id=path"))]
    assert "`where` (the argument on line" in found[0][2]
