"""Where the all_reduce of a logged loss goes: on the steps that log when every condition
around the log line is the same on every rank, before the first condition that is not
(on every pass) otherwise; never inside a condition a rank decides for itself."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''\
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LOG_EVERY = 5


class Config:
    def __init__(self, log_every):
        self.log_every = log_every


def train(model, loader, every):
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-every", type=int, default=2)
    args = parser.parse_args()
    cfg = Config(log_every=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    best, t0, step = 1e9, time.time(), 0
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
'''
TAIL = '''

def main():
    model = nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    train(model, loader, 2)
    torch.save(model.state_dict(), "m.pt")


if __name__ == "__main__":
    main()
'''


def rewritten(log: str) -> str:
    source = HEAD + "        " + dedent(log).replace("\n", "\n        ").rstrip() + "\n" + TAIL
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    return result.code.decode(), result


def placement(log: str) -> str:
    """The loop's lines from the first one this test wrote, dedented."""
    code, _ = rewritten(log)
    body = code.split("        step += 1\n", 1)[1].split("\n\n", 1)[0]
    return dedent(body) + "\n"


REDUCE = (
    "loss_avg = loss.detach().clone()\n"
    "dist.all_reduce(loss_avg)  # a sum: gloo has no ReduceOp.AVG\n"
    "loss_avg /= dist.get_world_size()\n"
)


def _under(test: str) -> str:
    inner = REDUCE + "if dist.get_rank() == 0:\n    print(loss_avg.item())\n"
    return f"if {test}:\n" + "".join("    " + line + "\n" for line in inner.splitlines())


def test_uniform_conditions_keep_the_all_reduce_on_the_steps_that_log():
    for test in ("i % args.log_every == 0", "step % cfg.log_every == 0", "(i + 1) % LOG_EVERY == 0",
                 "step % 4 == 0 or step == len(loader)", "i in (0, 3)"):
        assert placement(f"if {test}:\n    print(loss.item())\n") == _under(test), test


def test_a_rank_local_condition_takes_the_all_reduce_out_to_every_step():
    for test in ("loss.item() < best", "time.time() - t0 > 1.0", "step % every == 0", "x.sum() > 0"):
        got = placement(f"if {test}:\n    print(loss.item())\n")
        assert got == REDUCE + f"if {test}:\n    if dist.get_rank() == 0:\n        print(loss_avg.item())\n", test


def test_an_elif_is_decided_by_every_test_before_it():
    uniform = placement("if i % 3 == 0:\n    pass\nelif i % 3 == 1:\n    print(loss.item())\n")
    assert uniform.startswith("if i % 3 == 0:\n    pass\nelif i % 3 == 1:\n    loss_avg")
    local = placement("if loss.item() > 9:\n    pass\nelif i % 3 == 1:\n    print(loss.item())\n")
    assert local.startswith(REDUCE + "if loss.item() > 9:")


def test_a_uniform_condition_inside_a_rank_local_one_is_still_rank_local():
    got = placement("if loss.item() < best:\n    if i % 2 == 0:\n        print(loss.item())\n")
    assert got.startswith(REDUCE + "if loss.item() < best:\n    if i % 2 == 0:\n        if dist.get_rank() == 0:")


def test_a_rank_local_condition_that_changes_the_logged_loss_is_reported_not_averaged():
    code, result = rewritten("if loss.item() > 1:\n    loss = loss / 2\n    print(loss.item())\n")
    assert "all_reduce" not in code
    assert any("rank 0's own value" in a.what and "changes loss" in a.why for a in result.attention)


def test_the_report_says_why_the_all_reduce_runs_on_every_step():
    _, result = rewritten("if loss.item() < best:\n    print(loss.item())\n")
    assert any("on every pass" in c.what and "`if loss.item() < best` is not known" in c.what
               for c in result.changes)


def test_rank_tests_and_the_environment_are_never_rank_uniform():
    import libcst as cst

    from fsdp2_retrofit.analysis.rank_uniform import RankUniform
    from fsdp2_retrofit.syntax.names import Resolver

    source = dedent('''\
        import os
        import argparse
        import torch.distributed as dist
        args = argparse.ArgumentParser().parse_args()
        rank = dist.get_rank()
        env_rank = int(os.environ["LOCAL_RANK"])
        steps = 0
        if rank == 0: pass
        if dist.get_rank() == 0 and steps % 2 == 0: pass
        if args.local_rank == 0: pass
        if int(os.environ["RANK"]) == 0: pass
        if env_rank == 0: pass
        if master_process: pass
        if steps % args.every == 0: pass
    ''')
    module = cst.parse_module(source)
    resolver = Resolver(module)
    ifs = list(resolver.nodes(cst.If))
    uniform = RankUniform(resolver)
    assert [uniform.condition(i.test, i) for i in ifs] == [False] * 6 + [True]


def test_a_log_under_a_rank_test_and_a_step_test_gets_no_collective_under_either():
    """The script's own `if rank == 0 and step % 2 == 0:` keeps rank 0's loss (as the script
    printed it); no all_reduce lands under that test, nor under a rank test anywhere."""
    code, _ = rewritten("rank = 0\nif rank == 0 and step % 2 == 0:\n    print(loss.item())\n"
                        "if step % 2 == 0:\n    print(f'all {loss.item()}')\n")
    lines = code.splitlines()
    for n, line in enumerate(lines):
        if "dist.all_reduce(" in line:
            indent = len(line) - len(line.lstrip())
            opened = [l for l in lines[:n] if l.strip().startswith("if ") and len(l) - len(l.lstrip()) < indent]
            enclosing = []
            for l in reversed(opened):
                depth = len(l) - len(l.lstrip())
                if not enclosing or depth < enclosing[-1][0]:
                    enclosing.append((depth, l.strip()))
            assert not any("rank" in test for _, test in enclosing), (line, enclosing)
    assert code.count("dist.all_reduce(") == 1
