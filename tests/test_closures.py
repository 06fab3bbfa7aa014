"""Nested functions see the models and optimizers of the function around them: a
closure that reads `model` / `opt` without binding them holds the same objects."""
import libcst as cst

from fsdp2_retrofit.analysis.closures import closure_reads, free_reads, local_bindings
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

    def nested_helper(net, x):
        return net.forward(x)

    nested_helper(model, 1)

    def module_level():
        global model
        return model.forward(1)

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
    assert "model" not in names.get(fns["module_level"], set())  # `global`: the module's, not main's
    assert "m" in names[fns["report"]]  # the closure passes the model to a helper
    assert "net" in names[fns["nested_helper"]]  # a nested def handed the model as an argument
    assert "model" in facts.trained_names[fns["train_epoch"]]
    assert facts.optimizer_names[fns["train_epoch"]] == {"opt": "model"}
    assert "opt" not in facts.optimizer_names.get(fns["own_model"], {})
    forward = [facts.resolver.enclosing_function(c) for c in facts.forward_calls]
    assert forward == [fns["train_epoch"], fns["nested_helper"]]


def test_local_bindings_and_free_reads():
    fns = _functions(cst.parse_module(SCRIPT))
    assert {"batches", "x", "loss", "inner"} <= local_bindings(fns["train_epoch"])
    assert "model" not in local_bindings(fns["rebinds"])  # declared nonlocal
    assert "model" in local_bindings(fns["own_model"])
    assert {"model", "opt", "report"} <= free_reads(fns["train_epoch"])
    assert "model" not in free_reads(fns["own_model"])
    assert "model" in free_reads(fns["module_level"]) and "model" not in closure_reads(fns["module_level"])


# --- check: the forward rule sees inside a closure ---------------------------------

FSDP2_CLOSURE = '''\
import torch
from torch.distributed.fsdp import fully_shard


def main():
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())

    def train_epoch(loader):
        for x in loader:
            loss = model.forward(x).sum()
            loss.backward()
            opt.step()

    def shadowed(x):
        model = Other()
        return model.forward(x)

    train_epoch([1])
'''


def test_check_flags_forward_of_a_sharded_model_inside_a_closure():
    from fsdp2_retrofit.check.lint import lint_source
    from fsdp2_retrofit.check.rules import all_rules

    findings = lint_source(FSDP2_CLOSURE.encode(), "train.py", all_rules()).findings
    forward_line = next(n for n, line in enumerate(FSDP2_CLOSURE.splitlines(), 1) if "model.forward(x).sum()" in line)
    assert [(f.code, f.line) for f in findings if f.code == "FSD101"] == [("FSD101", forward_line)]


# --- rewrite: what cannot be followed is refused --------------------------------------

REBINDS = '''\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def main():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4)

    def wrap():
        nonlocal model
        model = {value}

    def train():
        for x, y in loader:
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    wrap()
    train()
    torch.save(model.state_dict(), "out.pt")


main()
'''


def test_a_nested_function_rebinding_the_model_is_refused():
    from fsdp2_retrofit.pipeline import rewrite_source

    source = REBINDS.format(value="torch.compile(model)")
    result = rewrite_source(source.encode(), "train.py")
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "model = torch.compile(model)" in text)
    assert [(r.code, r.line) for r in result.refusals][:1] == [("FSR627", line)]


def test_a_nested_function_switching_to_train_mode_is_not_refused():
    from fsdp2_retrofit.pipeline import rewrite_source

    result = rewrite_source(REBINDS.format(value="model.train()").encode(), "train.py")
    assert not result.refusals
    assert b"fully_shard(model" in result.code


_OPT_CLEARS = "            opt.zero_grad()\n            loss.backward()"
_MODEL_CLEARS = "            model.zero_grad()\n            loss.backward()"


def test_model_zero_grad_in_a_closure_with_a_partial_optimizer_is_refused():
    from fsdp2_retrofit.pipeline import rewrite_source

    source = REBINDS.format(value="model.train()").replace(
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)", "opt = torch.optim.SGD(model.fc.parameters(), lr=0.1)"
    ).replace(_OPT_CLEARS, _MODEL_CLEARS)
    result = rewrite_source(source.encode(), "train.py")
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "model.zero_grad()" in text)
    assert [(r.code, r.line) for r in result.refusals][:1] == [("FSR950", line)]


def test_model_zero_grad_in_a_closure_goes_through_the_optimizer():
    from fsdp2_retrofit.pipeline import rewrite_source

    source = REBINDS.format(value="model.train()").replace(_OPT_CLEARS, _MODEL_CLEARS)
    result = rewrite_source(source.encode(), "train.py")
    assert not result.refusals
    assert b"model.zero_grad()" not in result.code and result.code.count(b"opt.zero_grad()") == 1


def test_a_model_built_by_a_nested_factory_is_found():
    nested = "    def build():\n        return Net()\n\n    model = build()\n    opt ="
    source = SCRIPT.replace("    model = Net()\n    opt =", nested)
    module = cst.parse_module(source)
    facts = analyse(module)
    assert [(m.name, m.class_name) for m in facts.models] == [("model", "Net")]
    assert "model" in facts.model_names[_functions(module)["train_epoch"]]


def test_a_nested_factory_is_seen_only_where_its_name_reaches():
    other = "def other():\n    def build():\n        return Net()\n\n    return build\n\n\ndef report(m):"
    source = SCRIPT.replace("    model = Net()\n    opt =", "    model = build()\n    opt =")
    source = source.replace("def report(m):", other)
    facts = analyse(cst.parse_module(source))
    assert facts.models == []  # main's `build` is not other()'s nested one
