"""Each per-site analysis on its own: a small parsed script in, its typed sites out,
without ScriptFacts or any rewrite stage."""
import libcst as cst
import pytest

from fsdp2_retrofit.analysis.data import training_loaders
from fsdp2_retrofit.analysis.launch import distributed_init, distributed_wrappers, launch_names
from fsdp2_retrofit.analysis.logs import log_sites
from fsdp2_retrofit.analysis.loops import train_loops
from fsdp2_retrofit.analysis.models import module_bindings, trained_models
from fsdp2_retrofit.analysis.optimizers import optimizer_sites
from fsdp2_retrofit.syntax.names import Resolver, code

SCRIPT = '''
import os
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import DataLoader


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    model = Net()
    teacher = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(range(8), batch_size=2, shuffle=True)
    val = DataLoader(range(8), batch_size=2)
    for x in train:
        loss = model(x).sum()
        loss.backward()
        opt.step()
    for x in val:
        print(teacher(x))
    if rank == 0:
        print("done")
'''


@pytest.fixture(scope="module")
def parsed():
    module = cst.parse_module(SCRIPT)
    return module, Resolver(module)


def test_module_bindings_are_the_names_bound_to_module_instances(parsed):
    module, r = parsed
    assert [(name, cls) for name, _, cls in module_bindings(module, r)] == [("model", "Net"), ("teacher", "Net")]


def test_an_optimizer_site_names_the_models_it_trains(parsed):
    module, r = parsed
    (opt,) = optimizer_sites(module, r, module_bindings(module, r))
    assert (opt.name, opt.models) == ("opt", ["model"])
    assert code(opt.stmt).startswith("opt = torch.optim.SGD(")


def test_only_the_trained_model_is_a_model_site(parsed):
    module, r = parsed
    bindings = module_bindings(module, r)
    (site,) = trained_models(module, r, optimizer_sites(module, r, bindings), bindings)
    assert (site.name, site.class_name, site.scope.name.value) == ("model", "Net", "main")
    assert code(site.shard_anchor) == "model = Net()"


def test_a_training_loop_calls_backward(parsed):
    module, r = parsed
    (loop,) = train_loops(module, r)
    assert code(loop.node.iter) == "train" and loop.function.name.value == "main"
    assert loop.loader == "train"


def test_loaders_know_whether_a_training_loop_reads_them(parsed):
    module, r = parsed
    loaders = {site.name: site for site in training_loaders(module, r)}
    assert sorted(loaders) == ["train", "val"]
    assert loaders["train"].trains and not loaders["val"].trains
    assert code(loaders["train"].shuffle) == "True" and loaders["val"].shuffle is None
    assert not loaders["train"].has_sampler


def test_log_sites_know_whether_a_rank_test_gates_them(parsed):
    module, r = parsed
    logs = [(code(site.stmt), site.gated) for site in log_sites(module, r)]
    assert logs == [("print(teacher(x))", False), ('print("done")', True)]


def test_launch_facts(parsed):
    module, r = parsed
    main = next(s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == "main")
    assert launch_names(module, r, main) == (None, "rank")
    assert code(distributed_init(module, r)) == 'dist.init_process_group("gloo")'
    assert distributed_wrappers(module, r) == []


def test_launch_facts_name_each_wrapper_once():
    source = (
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "a = DDP(m)\nb = nn.DataParallel(m)\n"
    )
    module = cst.parse_module(source)
    r = Resolver(module)
    assert distributed_wrappers(module, r) == [(3, "DistributedDataParallel"), (4, "DataParallel")]
    assert distributed_init(module, r) is None
