"""shared_downloads (issue 32 B2): a dataset built with `download=True` is built by rank 0
first and by the other ranks after a barrier; each rank calls barrier once. The fixture
download_dataset runs it (an offline stand-in that fails when two ranks download at once)."""
from __future__ import annotations

from textwrap import dedent, indent

from fsdp2_retrofit.pipeline import rewrite_source

HEAD = dedent('''\
    import torch
    import torch.nn as nn
    from torchvision import datasets
    {top}

    def main(download=True):
        torch.manual_seed(0)
    {body}
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(torch.randn(2, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()


    main()
    ''')

PAIR = ("    if rank != 0:\n        dist.barrier()  # rank 0 downloads first\n"
        "{stmts}"
        "    if rank == 0:\n        dist.barrier()  # the files are there: the other ranks read them\n")


def _rewrite(body: str, top: str = ""):
    source = HEAD.format(top=top, body=indent(dedent(body), "    "))
    return rewrite_source(source.encode(), "/tmp/shared_downloads_case.py")


def test_consecutive_downloads_share_one_barrier_pair():
    stmts = ('train = datasets.MNIST("data", train=True, download=True)\n'
             'test = datasets.MNIST("data", train=False, download=True)\n')
    result = _rewrite(stmts)
    assert not result.refusals
    code = result.code.decode()
    assert PAIR.format(stmts=indent(stmts, "    ")) in code
    assert code.count("dist.barrier()") == 2
    assert code.index("dist.init_process_group(") < code.index("if rank != 0:")


def test_a_download_flag_handed_on_is_followed():
    result = _rewrite('cifar = datasets.CIFAR10("data", download=download)\n')
    assert "dist.barrier()  # rank 0 downloads first" in result.code.decode()


def test_download_false_by_value_is_left_alone():
    result = _rewrite('fetch = False\nds = datasets.MNIST("data", download=fetch)\n')
    assert "barrier" not in result.code.decode()
    assert not result.refusals


def test_a_class_with_a_download_parameter_that_is_no_dataset_is_left_alone():
    top = "\nclass Fetcher:\n    def __init__(self, root, download=False):\n        self.root = root\n"
    result = _rewrite('f = Fetcher("data", download=True)\n', top=top)
    assert "barrier" not in result.code.decode()


def test_a_project_dataset_class_with_download_is_one():
    top = ("\nclass Digits(torch.utils.data.Dataset):\n"
           "    def __init__(self, root, download=False):\n        self.root = root\n")
    result = _rewrite('d = Digits("data", download=True)\n', top=top)
    assert "dist.barrier()  # rank 0 downloads first" in result.code.decode()


def test_a_module_level_download_is_refused_at_its_line():
    result = _rewrite("pass\n", top='\nTRAIN = datasets.MNIST("data", download=True)\n')
    assert [r.code for r in result.refusals] == ["FSR637"]
    assert result.refusals[0].line == 5


def test_a_second_rewrite_adds_no_second_pair():
    first = _rewrite('train = datasets.MNIST("data", download=True)\n')
    assert rewrite_source(first.code, "/tmp/shared_downloads_case.py").code == first.code


# issue 44 class 9: the download runs inside a function of the script; the pair goes around each call of it
# (fixtures/rewrite/download_in_dataset_init: a Dataset class whose __init__ downloads, built twice in main)
WRAPPER = ("\nclass Scans(torch.utils.data.Dataset):\n"
           "    def __init__(self, root, train):\n"
           "        self.base = CIFAR10(root, train=train, download=True)\n"
           "\n    def __len__(self):\n        return len(self.base)\n")


def test_a_dataset_whose_init_downloads_is_built_behind_the_barriers():
    result = _rewrite('scans = Scans("data", train=True)\n',
                      top="from torchvision.datasets import CIFAR10\n" + WRAPPER)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert PAIR.format(stmts='    scans = Scans("data", train=True)\n') in code
    assert "        self.base = CIFAR10(root, train=train, download=True)\n" in code  # the class is left as it is
    assert code.count("dist.barrier()") == 2
    assert code.index("dist.init_process_group(") < code.index("if rank != 0:")


def test_a_helper_function_that_downloads_is_called_behind_the_barriers():
    top = "\ndef fetch_split(folder, training):\n    return datasets.FashionMNIST(folder, train=training, download=True)\n"
    result = _rewrite('a = fetch_split("data", True)\nb = fetch_split("data", False)\n', top=top)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert PAIR.format(stmts='    a = fetch_split("data", True)\n    b = fetch_split("data", False)\n') in code
    assert code.count("dist.barrier()") == 2
    assert rewrite_source(result.code, "/tmp/shared_downloads_case.py").code == result.code  # idempotent


def test_a_dataset_built_at_module_level_is_refused_at_the_download_with_the_line_that_runs_it():
    top = "from torchvision.datasets import CIFAR10\n" + WRAPPER + '\nSCANS = Scans("data", train=True)\n'
    result = _rewrite("pass\n", top=top)
    assert [r.code for r in result.refusals] == ["FSR637"]
    refusal = result.refusals[0]
    assert refusal.line == 8  # the CIFAR10 line in __init__
    assert '`Scans("data", train=True)` (line 13) runs it before the process group starts' in refusal.what


def test_a_download_in_a_function_nothing_here_calls_is_refused_with_that_reason():
    top = "\ndef fetch_split(folder):\n    return datasets.MNIST(folder, download=True)\n"
    result = _rewrite("pass\n", top=top)
    assert [r.code for r in result.refusals] == ["FSR637"]
    assert "in `fetch_split`, whose callers are not known" in result.refusals[0].what


def test_a_dataset_of_a_sibling_module_whose_init_downloads_is_built_behind_the_barriers(tmp_path):
    """download_in_dataset_init written as a project: Windows in corpus_data.py, main in train.py."""
    from pathlib import Path

    case = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "download_in_dataset_init"
    src = (case / "input.py").read_text()
    start, end = src.index("class Windows"), src.index("class Predictor")
    (tmp_path / "letters.py").write_text((case / "letters.py").read_text())
    (tmp_path / "corpus_data.py").write_text(
        "from torch.utils.data import Dataset\n\nfrom letters import Letters\n\n\n" + src[start:end].rstrip() + "\n")
    main = (src[:start] + src[end:]).replace("from letters import Letters\n", "from corpus_data import Windows\n")
    (tmp_path / "train.py").write_text(main)
    result = rewrite_source(main.encode(), str(tmp_path / "train.py"))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert PAIR.format(stmts='    train_set = Windows(args.root, "train")\n    val_set = Windows(args.root, "val")\n') in code
    assert any("`Windows(...)` builds Letters" in c.what for c in result.changes), result.changes


def test_a_download_in_a_function_that_trains_the_model_stays_inside_it():
    """A barrier pair around `fit(model)` would hold the other ranks while rank 0 trains alone (its
    all-gathers wait for them): the pair goes inside the function, around the download, as before."""
    top = ("\ndef fit(net):\n    data = datasets.MNIST(\"data\", download=True)\n"
           "    opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
           "    for _ in range(2):\n        net(torch.randn(2, 4)).sum().backward()\n        opt.step()\n")
    result = _rewrite("net = nn.Linear(4, 4)\nfit(net)\n", top=top)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "dist.barrier()  # rank 0 downloads first\n        fit(net)" not in code
    assert '    if dist.get_rank() != 0:\n        dist.barrier()  # rank 0 downloads first\n    data = datasets.MNIST(' in code
