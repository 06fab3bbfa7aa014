"""Evaluation figures and the decisions made from them (issue 32).

A loop over a DataLoader the rewrite splits (a helper that trains and evaluates, handed the test
loader too) sums over each rank's part of the data: the sums are combined over the ranks right
after the loop, on every rank (codemods/loop_sums.py), so the printed loss and accuracy are the
single run's and `if acc > best:` around a DCP save is decided alike on every rank (the rank
uniformity analysis follows `acc` through the helper's return). A condition around a collective
that reads a value of one rank's own data (its loss) is refused at its line (FSR640,
codemods/rank_decisions.py). The e2e test at the end runs the fixture eval_split_sums in one
process and on 2 ranks and compares the printed lines.
"""
from __future__ import annotations

import re
from pathlib import Path
from textwrap import dedent

import libcst as cst
import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset


    def run_epoch(model, loader, optimizer=None):
        total_loss, correct = 0.0, 0
        for x, y in loader:
            out = model(x)
            loss = F.cross_entropy(out, y)
            if optimizer is not None:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            total_loss += loss.item() * y.size(0)
            correct += (out.argmax(1) == y).sum().item()
        return total_loss / len(loader.dataset), correct / len(loader.dataset)


    def test(model, loader):
        correct = 0
        with torch.no_grad():
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum().item()
        return correct / len(loader.dataset)


    def main():
        torch.manual_seed(0)
        x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
        train_loader = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
        test_loader = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        best = 0.0
        for epoch in range(3):
    """)
TAIL = dedent("""\


    if __name__ == "__main__":
        main()
    """)


def _source(body: str) -> str:
    return HEAD + "".join("        " + line + "\n" if line else "\n" for line in dedent(body).splitlines()) + TAIL


def _rewrite(body: str):
    return rewrite_source(_source(body).encode(), "train.py", RetrofitOptions())


def _function(code: str, name: str) -> str:
    start = code.index(f"def {name}(")
    end = code.find("\ndef ", start + 1)
    return code[start:end]


SHARED = """\
run_epoch(model, train_loader, optimizer)
with torch.no_grad():
    test_loss, acc = run_epoch(model, test_loader)
print(f"test loss {test_loss:.4f} acc {acc:.4f}")
if acc > best:
    best = acc
    torch.save(model.state_dict(), "best.pt")
"""


def test_sums_of_a_split_evaluation_are_combined_after_its_loop_on_every_rank():
    result = _rewrite(SHARED)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    helper = _function(code, "run_epoch")
    lines = [l.strip() for l in helper.splitlines()]
    gather = lines.index("sums_ranks = [None] * dist.get_world_size()")
    assert lines[gather - 1] == "correct += (out.argmax(1) == y).sum().item()"  # right after the loop
    assert helper.splitlines()[lines.index("sums_ranks = [None] * dist.get_world_size()")].startswith("    sums")
    assert lines[gather + 1:gather + 4] == [
        "dist.all_gather_object(sums_ranks, (total_loss, correct))  # every rank's own sums",
        "total_loss = sum(r[0] for r in sums_ranks)",
        "correct = sum(r[1] for r in sums_ranks)",
    ]
    assert code.count("all_gather_object") == 1  # the print reads the combined figures: not gathered again
    assert [c for c in result.changes if c.code == "loop_sums" and "`total_loss`, `correct`" in c.what]


def test_an_evaluation_every_rank_reads_whole_is_left_alone_and_its_decision_passes():
    result = _rewrite("""\
        run_epoch(model, train_loader, optimizer)
        acc = test(model, test_loader)
        if acc > best:
            best = acc
            torch.save(model.state_dict(), "best.pt")
        """)
    assert not result.refusals, result.refusals
    assert "all_gather_object" not in _function(result.code.decode(), "test")


def test_a_save_decided_by_a_ranks_own_loss_is_refused_at_the_condition():
    body = """\
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if loss.item() < 0.5:
            torch.save(model.state_dict(), "best.pt")
        """
    result = _rewrite(body)
    source = _source(body).splitlines()
    line = source.index("        if loss.item() < 0.5:") + 1
    assert [(r.code, r.line) for r in result.refusals] == [("FSR640", line)]
    what = result.refusals[0].what
    assert "`loss` is each rank's own value" in what and "checkpoint save" in what


def test_an_early_stop_on_a_ranks_own_loss_is_refused_at_the_break():
    body = """\
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 0.01:
                break
        """
    result = _rewrite(body)
    line = _source(body).splitlines().index("            if loss.item() < 0.01:") + 1
    assert [(r.code, r.line) for r in result.refusals] == [("FSR640", line)]
    assert "`break`" in result.refusals[0].what


def test_the_same_names_for_the_test_batches_are_not_the_training_batches():
    """`for x, y in test_loader:` rebinds the names of the training loop's batch: inside it they
    hold the test loader's (every rank's alike); a renamed copy gets the same outcome."""
    body = """\
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += (model(x).argmax(1) == y).sum().item()
        acc = correct / len(test_loader.dataset)
        if acc > best:
            best = acc
            torch.save(model.state_dict(), "best.pt")
        """
    assert not _rewrite(body).refusals
    renamed = body.replace("for x, y in test_loader", "for xt, yt in test_loader").replace(
        "model(x).argmax(1) == y", "model(xt).argmax(1) == yt")
    assert not _rewrite(renamed).refusals


def test_a_sum_not_recognised_stays_rank_local_and_its_save_is_refused():
    body = """\
        run_epoch(model, train_loader, optimizer)
        score = 0.0
        for x, y in train_loader:
            score += (model(x) - 1).abs().mean().item() / 2
        if score > best:
            torch.save(model.state_dict(), "best.pt")
        """
    result = _rewrite(body)
    line = _source(body).splitlines().index("        if score > best:") + 1
    assert [(r.code, r.line) for r in result.refusals] == [("FSR640", line)]


def test_a_split_loop_under_a_ranks_own_condition_is_refused():
    body = """\
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if loss.item() > 0.1:
            test_loss, acc = run_epoch(model, test_loader)
        """
    result = _rewrite(body)
    codes = [r.code for r in result.refusals]
    assert codes and set(codes) <= {"FSR639", "FSR640"}, codes
    assert any(r.code == "FSR640" and "a call handed the sharded model (`run_epoch(model, test_loader)`" in r.what
               for r in result.refusals)


def test_a_figure_returned_through_a_helper_is_rank_uniform():
    from fsdp2_retrofit.analysis import analyse
    from fsdp2_retrofit.analysis.rank_uniform import RankUniform

    facts = analyse(cst.parse_module(_source(SHARED)))
    r = facts.resolver
    uniform = RankUniform(r, {l.name for l in facts.loaders}, facts=facts)
    gate = next(i for i in r.nodes(cst.If) if cst.Module([]).code_for_node(i.test) == "acc > best")
    assert uniform.condition(gate.test, gate)
    assert not RankUniform(r, {l.name for l in facts.loaders}).condition(gate.test, gate)  # without the facts


# --- e2e: the printed figures are the single run's -----------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"


def _numbers(line: str):
    return [float(x) for x in re.findall(r"-?\d+\.\d+|\d+", line)]


@pytest.mark.e2e
def test_the_printed_test_loss_and_accuracy_are_the_single_runs(tmp_path: Path):
    pytest.importorskip("torch")
    from fsdp2_retrofit.verify import launch_distributed, launch_single

    folder = FIXTURES / "eval_split_sums"
    single = launch_single(folder / "input.py", ["--batch-size", "32"], tmp_path / "single")
    # ranks that decide `acc > best_acc` apart hang in the DCP save: a short timeout says so
    dist = launch_distributed(folder / "expected.py", ["--batch-size", "16"], tmp_path / "dist", nproc=2, timeout=90)
    for kind in ("epoch ", "best acc "):
        ours = [l for l in dist.stdout.splitlines() if l.startswith(kind)]
        theirs = [l for l in single.stdout.splitlines() if l.startswith(kind)]
        assert len(ours) == len(theirs) > 0, (kind, ours, theirs)  # once, and at the same epochs
        for a, b in zip(ours, theirs):
            x, y = _numbers(a), _numbers(b)
            # 4 decimals printed: a sum in another order may round the last digit the other way
            assert len(x) == len(y) and all(abs(p - q) <= 1.01e-4 for p, q in zip(x, y)), (a, b)
    assert len([l for l in single.stdout.splitlines() if l.startswith("best acc ")]) >= 2


# --- a log line that runs the model: computed on every rank, printed on rank 0 -----

def test_a_log_line_that_evaluates_the_model_computes_first_and_prints_on_rank_zero():
    result = _rewrite("""\
        run_epoch(model, train_loader, optimizer)
        print(f"epoch {epoch} acc {test(model, test_loader):.4f} of {len(test_loader.dataset)}")
        """)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert ("        logged_value = test(model, test_loader)\n"
            "        if rank == 0:\n"
            '            print(f"epoch {epoch} acc {logged_value:.4f} of {len(test_loader.dataset)}")\n') in code
    assert not [a for a in result.attention if "left on every rank" in a.what]


@pytest.mark.parametrize("line", [
    'print(f"acc {test(model, test_loader):.4f}", open("log.txt", "a").write("x"))',  # another call with effects
    'print(epoch > 0 and test(model, test_loader))',  # runs only when epoch > 0
    'print([test(model, test_loader) for _ in range(2)])',  # runs twice
])
def test_a_log_line_whose_order_would_change_stays_on_every_rank(line):
    result = _rewrite("run_epoch(model, train_loader, optimizer)\n" + line + "\n")
    code = result.code.decode()
    assert "logged_value" not in code and "        " + line + "\n" in code
    assert [a for a in result.attention if "left on every rank" in a.what]


def test_sums_of_a_split_loop_under_a_ranks_own_condition_are_refused_at_the_loop():
    body = """\
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if loss.item() > 0.1:
            seen = 0
            for xb, yb in train_loader:
                seen += yb.size(0)
            print(seen)
        """
    result = _rewrite(body)
    line = _source(body).splitlines().index("            for xb, yb in train_loader:") + 1
    assert [(r.code, r.line) for r in result.refusals][:1] == [("FSR639", line)]
    assert "`if loss.item() > 0.1`" in result.refusals[0].what


def test_a_loop_handed_a_split_loader_and_a_whole_one_is_flagged_not_combined():
    result = _rewrite("""\
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(test(model, train_loader), test(model, test_loader))
        """)
    assert not result.refusals, result.refusals
    assert "all_gather_object" not in _function(result.code.decode(), "test")
    assert [a for a in result.attention if a.code == "loop_sums" and "`correct`" in a.what and a.differs]


def test_a_save_decided_by_an_epoch_sum_is_made_uniform_not_refused():
    """`epoch_loss += loss.item()` over the split training loader, then `if epoch_loss < best:`
    around a save: the sum is combined after the loop (a sum of batch means: divided by the world
    size), so the decision is every rank's alike."""
    body = """\
        epoch_loss = 0.0
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item()
        if epoch_loss < best:
            best = epoch_loss
            torch.save(model.state_dict(), "best.pt")
        else:
            break
        """
    result = _rewrite(body)
    assert not result.refusals, result.refusals
    assert ("            epoch_loss += loss.item()\n"
            "        epoch_loss_ranks = [None] * dist.get_world_size()\n"
            "        dist.all_gather_object(epoch_loss_ranks, epoch_loss)  # every rank's own sum\n"
            "        epoch_loss = sum(epoch_loss_ranks) / dist.get_world_size()\n"
            "        if epoch_loss < best:\n") in result.code.decode()
