"""Nested functions see the models and optimizers of the function around them: a
closure that reads `model` / `opt` without binding them holds the same objects."""
import libcst as cst

from fsdp2_retrofit.analysis.closures import free_reads, local_bindings
from fsdp2_retrofit.analysis.facts import analyse

SCRIPT = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


def report(m):
    return m.fc.weight.norm()


def main():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_epoch(batches):
        for x in batches:
            loss = model.forward(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        report(model)

        def inner():
            return model(batches[0])

        return inner()

    def own_model(x):
        model = Net()
        return model(x)

    def rebinds():
        nonlocal model
        model = model.eval()

    def via_alias(x):
        net = model
        return net(x)

    train_epoch([torch.randn(2, 4)])
'''


def _functions(module):
    out = {}

    class _V(cst.CSTVisitor):
        def visit_FunctionDef(self, node):
            out[node.name.value] = node

    module.visit(_V())
    return out


def test_closure_holds_the_enclosing_model_and_optimizer():
    module = cst.parse_module(SCRIPT)
    facts = analyse(module)
    fns = _functions(module)
    names = facts.model_names
    assert "model" in names[fns["train_epoch"]]
    assert "model" in names[fns["inner"]]  # two levels down
    assert "model" in names[fns["rebinds"]]  # nonlocal: the same binding
    assert {"net", "model"} <= names[fns["via_alias"]]
    assert "model" not in names.get(fns["own_model"], set())  # its own local model
    assert "m" in names[fns["report"]]  # the closure passes the model to a helper
    assert "model" in facts.trained_names[fns["train_epoch"]]
    assert facts.optimizer_names[fns["train_epoch"]] == {"opt": "model"}
    assert "opt" not in facts.optimizer_names.get(fns["own_model"], {})
    forward = [c for c in facts.forward_calls]
    assert [facts.resolver.enclosing_function(c) for c in forward] == [fns["train_epoch"]]


def test_local_bindings_and_free_reads():
    fns = _functions(cst.parse_module(SCRIPT))
    assert {"batches", "x", "loss", "inner"} <= local_bindings(fns["train_epoch"])
    assert "model" not in local_bindings(fns["rebinds"])  # declared nonlocal
    assert "model" in local_bindings(fns["own_model"])
    assert {"model", "opt", "report"} <= free_reads(fns["train_epoch"])
    assert "model" not in free_reads(fns["own_model"])
