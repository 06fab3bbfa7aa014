"""What people read in the logs and files of a retrofitted run is the single run's (issue 29,
items 3 and 4).

A loss logged through a tensor read other than `loss.item()` (`.data.numpy()`,
`.detach().cpu().numpy()`, `.cpu().item()`) is averaged over the ranks like `loss.item()`;
a float summed over the training loop and logged by name (an epoch summary) is gathered from
every rank, before the rank-0 print; a hand-written stdout progress bar (write, then flush) is
gated whole; plain-file writes go to rank 0; `if not isdir(d): os.mkdir(d)` becomes
`os.makedirs(d, exist_ok=True)` (tests/test_make_dirs.py). The e2e tests at the end run the
fixtures epoch_loss_logs and rank_zero_file_writes in one process and on 2 ranks and compare
what they print and the files they write.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from textwrap import dedent

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import json
    import os
    import sys

    import numpy as np
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8, shuffle=True)
    test_loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    for epoch in range(2):
        running_loss = 0.0
        sample_loss = 0.0
        seen = 0
        steps = 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            per_sample_loss = nn.functional.cross_entropy(model(x), y, reduction="none")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            sample_loss += loss.item() * x.size(0)
            seen += x.size(0)
            steps += 1
            STEP
        EPOCH
    """)


def _rewrite(step: str = "pass", epoch: str = "pass", options=None):
    source = SCRIPT.replace("STEP", step.replace("\n", "\n" + " " * 8)).replace(
        "EPOCH", epoch.replace("\n", "\n" + " " * 4))
    result = rewrite_source(source.encode(), "train.py", options)
    assert not result.refusals, result.refusals
    return result.code.decode(), result


def _body(code: str) -> str:
    return code[code.index("for epoch"):]


# --- item 3a: a loss read through NumPy or .cpu() ----------------------------


@pytest.mark.parametrize("read", ["loss.data.numpy()", "loss.detach().cpu().numpy()", "loss.cpu().item()",
                                  "loss.detach().item()", "loss.data.item()"])
def test_a_loss_read_through_a_chain_is_averaged_before_the_gate(read):
    code, _ = _rewrite(f"print('loss', {read})")
    body = _body(code)
    assert "loss_avg = loss.detach().clone()\n" in body
    assert "dist.all_reduce(loss_avg)" in body and "loss_avg /= dist.get_world_size()" in body
    assert f"print('loss', {read.replace('loss.', 'loss_avg.', 1)})" in body
    # the collective runs on every rank: before the rank-0 `if`, not under it
    assert body.index("dist.all_reduce(loss_avg)") < body.index("if rank == 0:")


def test_numpy_of_a_loss_that_is_not_a_scalar_is_flagged_not_averaged():
    code, result = _rewrite("print(per_sample_loss.detach().numpy())")
    assert "per_sample_loss_avg" not in code and "all_reduce" not in code
    flagged = [a for a in result.attention if a.code == "rank_zero"]
    assert flagged and "`per_sample_loss.detach().numpy()` is logged as rank 0's own value" in flagged[0].what
    assert flagged[0].line == SCRIPT[:SCRIPT.index("STEP")].count("\n") + 1


def test_no_reduce_logs_prints_rank_zeros_own():
    code, _ = _rewrite("print(loss.data.numpy())", "print(running_loss / len(loader))",
                       RetrofitOptions(reduce_logs=False))
    assert "all_reduce" not in code and "all_gather_object" not in code


# --- item 3b: a float summed over the loader ---------------------------------


def test_an_epoch_summary_of_batch_means_is_gathered_and_divided_by_the_world_size():
    code, _ = _rewrite(epoch="print(running_loss / len(loader.dataset), running_loss / len(loader))")
    body = _body(code)
    assert ("running_loss_ranks = [None] * dist.get_world_size()\n"
            "    dist.all_gather_object(running_loss_ranks, running_loss)") in body
    assert "running_loss_avg = sum(running_loss_ranks) / dist.get_world_size()\n" in body
    assert "print(running_loss_avg / len(loader.dataset), running_loss_avg / len(loader))" in body
    assert body.index("all_gather_object") < body.index("if rank == 0:")


def test_a_per_sample_sum_and_a_sample_count_are_summed_a_step_count_left():
    code, _ = _rewrite(epoch="print(sample_loss / seen, sample_loss / len(loader.dataset), steps)")
    body = _body(code)
    # one gather for both values
    assert "dist.all_gather_object(logged_ranks, (sample_loss, seen))" in body and body.count("all_gather_object") == 1
    assert "sample_loss_all = sum(r[0] for r in logged_ranks)\n" in body
    assert "seen_all = sum(r[1] for r in logged_ranks)\n" in body
    assert "steps" not in body[body.index("all_gather_object"):body.index("if rank == 0:")]  # the same on every rank
    assert "print(sample_loss_all / seen_all, sample_loss_all / len(loader.dataset), steps)" in body


def test_an_accumulator_outside_the_split_loader_stays_rank_zeros_evaluation():
    """An evaluation loop over a loader every rank reads whole: summing over the ranks would
    count each sample world_size times."""
    code, _ = _rewrite(epoch=dedent("""\
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += (model(x).argmax(1) == y).sum().item()
        print(correct / len(test_loader.dataset))"""))
    assert "all_gather_object" not in code and "correct_total" not in code


def test_a_loss_summed_some_other_way_is_flagged_at_the_print():
    source_epoch = "print(odd / len(loader))"
    code, result = _rewrite("odd += loss.item() / 2", "odd = 0.0\n" + source_epoch)
    assert "all_gather_object" not in code
    flagged = [a for a in result.attention if a.code == "rank_zero" and "`odd`" in a.what]
    assert flagged and "rank 0's own figure" in flagged[0].what


def test_a_second_rewrite_adds_nothing():
    code, _ = _rewrite("print(loss.data.numpy())", "print(running_loss / len(loader))")
    again = rewrite_source(code.encode(), "train.py")
    assert again.code.decode().count("all_gather_object") == 1 and again.code.decode().count("all_reduce(") == 1


# --- item 3c: a hand-written progress bar --------------------------------------


def test_a_stdout_progress_bar_is_gated_whole():
    code, _ = _rewrite("sys.stdout.write(f'\\rstep {steps}')\nsys.stdout.flush()\nprint(f'step {steps}', end='\\r')")
    body = _body(code)
    gate = body.index("if rank == 0:")
    assert body.index("sys.stdout.write") > gate and body.index("sys.stdout.flush()") > gate
    assert "            sys.stdout.flush()\n" in body  # under the gate, not beside it
    assert body.count("if rank == 0:") == 1


HELPERS = dedent("""\
    clock = 0
    ticks = 0


    def fmt(n):
        return f"{n:04d}"


    def bar(i, msg):
        global ticks
        ticks += 1
        sys.stdout.write(f"\\r[{fmt(i)}] {msg}")
        sys.stdout.flush()


    def show(m, i):
        print(i, m(torch.zeros(1, 4)).sum().item())


    def uses_model(i):
        print(i, model.training)
        model.train()


    def bar_returns(i):
        print(i)
        return i


    def bar_clock_read(i):
        global clock
        clock = i
        print(i)


    """)


@pytest.mark.parametrize("call, gated", [
    ("bar(steps, 'loss %.3f' % (running_loss / steps))", True),  # a bar helper with its own clock
    ("show(model, steps)", False),  # it runs the model: a forward every rank must join
    ("uses_model(steps)", False),  # it calls the script's module-level model (a train(epoch) of the script)
    ("bar_returns(steps)", False),  # a value back (even unused: the helper may do more than print)
    ("bar_clock_read(steps)", False),  # a global the script reads below
])
def test_a_progress_bar_helper_of_the_script_is_called_on_rank_zero(call, gated):
    source = SCRIPT.replace("model = nn.Sequential", HELPERS + "model = nn.Sequential", 1)
    source = source.replace("STEP", call).replace("EPOCH", "print(clock)")
    code = rewrite_source(source.encode(), "train.py").code.decode()
    body = _body(code)
    assert (f"if rank == 0:\n            {call.replace('running_loss', 'running_loss_avg')}" in body) is gated, body
    if gated:  # the loss it shows is the run's, gathered before the gate
        assert "running_loss_avg = sum(running_loss_ranks) / dist.get_world_size()" in body
        assert "'loss %.3f' % (running_loss_avg / steps)" in body


# --- item 4: plain-file writes ------------------------------------------------


@pytest.mark.parametrize("write", [
    "open('log.txt', 'w').write(f'{epoch}\\n')",
    "json.dump({'epoch': epoch}, open('summary.json', 'w'))",
    "np.save('epochs.npy', np.arange(epoch + 1))",
    "with open('log.txt', 'a') as f:\n    f.write(f'{epoch}\\n')\n    print(epoch, file=f)",
    "with open('log.txt', mode='a') as f:\n    json.dump({'epoch': epoch}, f)",
])
def test_a_plain_file_write_is_gated_on_rank_zero(write):
    code, result = _rewrite(epoch=write)
    body = _body(code)
    first = write.split("\n")[0]
    assert f"    if rank == 0:\n        {first}" in body, body
    assert body.count("if rank == 0:") == 1


@pytest.mark.parametrize("write", [
    "with open('log.txt', 'a') as f:\n    f.write(str(model(torch.randn(2, 4))))",  # a forward: every rank
    "with open('log.txt', 'a') as f:\n    n = f.write('x')",  # more than writes
    "np.save('idx.npy', np.arange(4))\nidx = np.load('idx.npy')",  # read back: every rank needs it first
    "open(f'log{int(os.environ[\"RANK\"])}.txt', 'w').write('x')",  # each rank its own file
    "open('log.txt').read()",  # no write
])
def test_other_file_statements_stay_on_every_rank(write):
    code, _ = _rewrite(epoch=write)
    assert "if rank == 0:" not in _body(code)


# --- e2e: the printed figures and the written files are the single run's ------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"


def _runs(case: str, tmp_path: Path):
    pytest.importorskip("torch")
    from fsdp2_retrofit.verify import launch_distributed, launch_single

    folder = FIXTURES / case
    single = launch_single(folder / "input.py", ["--batch-size", "32"], tmp_path / "single")
    dist = launch_distributed(folder / "expected.py", ["--batch-size", "16"], tmp_path / "dist", nproc=2)
    return single, dist


def _numbers(lines):
    return [float(x) for line in lines for x in re.findall(r"-?\d+\.\d+|\d+", line)]


@pytest.mark.e2e
def test_the_printed_figures_are_the_single_runs(tmp_path: Path):
    single, dist = _runs("epoch_loss_logs", tmp_path)
    for kind in ("step", "window", "epoch"):
        ours = [l for l in dist.stdout.splitlines() if l.startswith(kind + " ")]
        theirs = [l for l in single.stdout.splitlines() if l.startswith(kind + " ")]
        assert len(ours) == len(theirs) > 0, (kind, ours, theirs)  # once, not once a rank
        a, b = _numbers(ours), _numbers(theirs)
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (kind, ours, theirs)
    assert dist.stdout.count("progress") == single.stdout.count("progress") > 0
    assert dist.stdout.count("bar [") == single.stdout.count("bar [") > 0  # the helper's bar, once
    bars = [re.findall(r"bar \[\d+/\d+\] loss (\S+) seen (\d+)", run.stdout) for run in (dist, single)]
    assert len(bars[0]) == len(bars[1]) and all(
        abs(float(a[0]) - float(b[0])) < 1e-5 and a[1] == b[1] for a, b in zip(*bars)), bars


@pytest.mark.e2e
def test_the_written_files_are_the_single_runs(tmp_path: Path):
    single, dist = _runs("rank_zero_file_writes", tmp_path)
    ours, theirs = dist.directory / "logs", single.directory / "logs"
    for name in ("metrics.txt", "summary.json", "status.txt"):
        assert (ours / name).read_text() == (theirs / name).read_text(), name
    assert json.loads((ours / "summary.json").read_text()) == {"epoch": 1, "steps": 8}
    a, b = (ours / "steps.txt").read_text().splitlines(), (theirs / "steps.txt").read_text().splitlines()
    assert len(a) == len(b) == 8  # each step's line once
    assert max(abs(x - y) for x, y in zip(_numbers(a), _numbers(b))) < 1e-5
    assert (ours / "epochs.npy").read_bytes() == (theirs / "epochs.npy").read_bytes()


def test_tqdm_write_under_a_rank_zero_test_gets_no_disable_keyword():
    """Only tqdm's bars take `disable=`; `tqdm.write(s)` is a log line (its signature has no
    `disable`: TypeError). It came up rewriting uoguelph-mlrg/Cutout's output again: the
    first pass gates `tqdm.write(...)` under `if rank == 0:`, the second added
    `disable=rank != 0` to it (the rewrite was not idempotent, and the output would raise)."""
    source = dedent('''\
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset
        from tqdm import tqdm

        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
        for epoch in range(2):
            for x, y in tqdm(loader):
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            tqdm.write('epoch %d' % epoch)
        ''')
    once = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not once.refusals, once.refusals
    first = once.code.decode()
    assert "tqdm(loader, disable=rank != 0)" in first
    assert "    if rank == 0:\n        tqdm.write('epoch %d' % epoch)\n" in first
    twice = rewrite_source(once.code, "train.py", RetrofitOptions())
    assert "disable" not in [line for line in twice.code.decode().splitlines() if "tqdm.write" in line][0]
    assert twice.code == once.code


# --- issue 44 class 4: writers, figures and images write one path on every rank ----------------


@pytest.mark.parametrize("setup, use", [
    ("w = csv.writer(open('m.csv', 'w'))", "w.writerow([epoch])"),
    ("fh = open('m.csv', 'w', newline='')\nw = csv.DictWriter(fh, fieldnames=['e'])", "w.writerow({'e': epoch})"),
    ("tb = SummaryWriter('runs')", "tb.add_scalar('loss', loss.item(), epoch)"),
])
def test_a_writer_is_made_and_used_on_rank_zero_only(setup, use):
    code, _ = _rewrite_with_setup(setup, use)
    head = code[:code.index("for epoch")]
    assert "if rank == 0:\n    " + "\n    ".join(setup.split("\n")) in head, head  # made on rank 0 only
    assert f"    if rank == 0:\n        {use}" in _body(code).replace("loss_avg", "loss"), _body(code)


def _rewrite_with_setup(setup: str, use: str):
    source = SCRIPT.replace("for epoch in", "import csv\nfrom torch.utils.tensorboard import SummaryWriter\n"
                            + setup + "\nfor epoch in", 1)
    source = source.replace("STEP", "pass").replace("EPOCH", use)
    result = rewrite_source(source.encode(), "train.py", None)
    assert not result.refusals, result.refusals
    return result.code.decode(), result


@pytest.mark.parametrize("write", [
    "plt.savefig('curve.png')",
    "fig.savefig(f'curve_{epoch}.png', dpi=80)",
    "save_image(x, 'batch.png', normalize=True)",
])
def test_a_figure_or_image_file_is_written_on_rank_zero(write):
    source = SCRIPT.replace("import json", "import json\nimport matplotlib.pyplot as plt\n"
                            "from torchvision.utils import save_image\nfig = plt.figure()", 1)
    source = source.replace("STEP", "pass").replace("EPOCH", write)
    code = rewrite_source(source.encode(), "train.py", None).code.decode()
    assert f"    if rank == 0:\n        {write}" in _body(code), _body(code)


@pytest.mark.parametrize("image, after", [
    ("model(torch.randn(4, 4))", "logged_value"),
    ("model(torch.randn(4, 4)).mul(0.5).add(0.5).view(-1, 1, 2, 1)", "logged_value.mul(0.5).add(0.5).view(-1, 1, 2, 1)"),
])
def test_an_image_of_the_sharded_model_is_computed_on_every_rank_first(image, after):
    """`save_image(G(z), path)`: the forward is bound before the gate, on every rank; only the
    write (with what it does to the tensor locally) is on rank 0: a forward inside the gate would
    hang the other ranks."""
    source = SCRIPT.replace("import json", "import json\nimport torchvision.utils as vutils", 1)
    source = source.replace("STEP", "pass").replace("EPOCH", f"vutils.save_image({image}, 'out.png')")
    code = rewrite_source(source.encode(), "train.py", None).code.decode()
    body = _body(code)
    assert ("    logged_value = model(torch.randn(4, 4))\n    if rank == 0:\n"
            f"        vutils.save_image({after}, 'out.png')") in body, body


@pytest.mark.parametrize("use, why", [
    ("log_epoch(w, epoch)", "is used here otherwise"),  # handed to a function
    ("w.writerow([model(x).sum().item() if epoch else 0])", "computes with the model"),  # a forward in a condition
])
def test_a_writer_that_cannot_go_to_rank_zero_whole_is_left_and_reported(use, why):
    source = SCRIPT.replace("for epoch in", "import csv\n\ndef log_epoch(out, e):\n    out.writerow([e])\n\n"
                            "w = csv.writer(open('m.csv', 'w'))\nfor epoch in", 1)
    source = source.replace("STEP", "pass").replace("EPOCH", use)
    result = rewrite_source(source.encode(), "train.py", None)
    code = result.code.decode()
    assert "if rank == 0:\n    w = csv.writer" not in code
    assert "    w = csv.writer(open('m.csv', 'w'))" not in code and "w = csv.writer(open('m.csv', 'w'))" in code
    notes = [a for a in result.attention if "writ" in a.what]
    assert any(why in a.what for a in notes), [a.what for a in result.attention]


def test_a_writer_made_before_the_process_group_reads_the_launchers_rank():
    """A writer made above the process group's start: `dist.get_rank()` would fail there, so its
    construction (and its uses above the group) test torchrun's RANK; its uses below, `rank`."""
    source = dedent("""\
        import csv
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset


        def main():
            w = csv.writer(open('m.csv', 'w'))
            w.writerow(['epoch'])
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8)
            for epoch in range(2):
                for x, y in loader:
                    loss = nn.functional.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                w.writerow([epoch])


        main()
        """)
    result = rewrite_source(source.encode(), "train.py", None)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert ('    if os.environ.get("RANK", "0") == "0":\n        w = csv.writer(open(\'m.csv\', \'w\'))\n'
            "        w.writerow(['epoch'])\n") in code, code
    assert code.index("w = csv.writer") < code.index("init_process_group")
    assert "        if rank == 0:\n            w.writerow([epoch])" in code, code
    assert "import os" in code


@pytest.mark.e2e
@pytest.mark.parametrize("case, files", [
    ("rank_zero_csv_writer", {"metrics.csv": ["--metrics"]}),
    ("rank_zero_csv_writer_variant", {"metrics.csv": ["--steps-csv"], "epochs.csv": ["--epochs-csv"]}),
])
def test_a_csv_log_is_written_once_and_is_the_single_runs(case, files, tmp_path: Path):
    single, dist = _runs(case, tmp_path)
    for name in files:
        ours = (dist.directory / name).read_text().splitlines()
        theirs = (single.directory / name).read_text().splitlines()
        assert len(ours) == len(theirs) > 2, (name, ours, theirs)  # each row once, not once a rank
        assert ours[0] == theirs[0] and ours.count(ours[0]) == 1  # one header
        a, b = _numbers(ours), _numbers(theirs)
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (name, ours, theirs)


@pytest.mark.parametrize("setup, epoch, why", [
    ("class Log:\n    def __init__(self):\n        self.w = csv.writer(open('m.csv', 'w'))\n\n    def row(self, e):\n"
     "        self.w.writerow([e])\n\nlog = Log()", "log.row(epoch)", "bound to `self.w`"),
    ("tb = None\ntb = SummaryWriter('runs')", "tb.add_scalar('e', epoch)", "bound 2 times"),
])
def test_a_writer_the_rewrite_cannot_follow_is_reported_at_its_construction(setup, epoch, why):
    source = SCRIPT.replace("for epoch in", "import csv\nfrom torch.utils.tensorboard import SummaryWriter\n"
                            + setup + "\nfor epoch in", 1)
    result = rewrite_source(source.replace("STEP", "pass").replace("EPOCH", epoch).encode(), "train.py", None)
    assert "if rank == 0:\n    tb = SummaryWriter" not in result.code.decode()
    assert any("writes the same file on every rank" in a.what and why in a.what for a in result.attention), \
        [a.what for a in result.attention]


def test_a_file_opened_around_the_training_is_reported():
    source = SCRIPT.replace("for epoch in range(2):", "with open('m.csv', 'w') as fh:\n  w = csv.writer(fh)\n"
                            "  for epoch in range(2):", 1).replace("\n    ", "\n      ")
    source = "import csv\n" + source.replace("STEP", "pass").replace("EPOCH", "w.writerow([epoch])")
    result = rewrite_source(source.encode(), "train.py", None)
    assert any("opened around more than writes" in a.what for a in result.attention), \
        [a.what for a in result.attention]
