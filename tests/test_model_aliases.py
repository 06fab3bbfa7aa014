"""Issue 27: a name whose value is the model is the model. `m = model.to(device)` (or
`.cuda()`, `.float().train()`: an nn.Module's placement and mode methods return the
module itself), and a parameter handed such a name, hold the sharded model: a method
called on them (`m.generate(...)`) is registered as an FSDP forward method, and a
print that runs it stays on every rank (under `if rank == 0:` rank 0 would all-gather
alone: a crash on gloo, a hang on NCCL). The outcome is the one of the script that
spells `model.generate(...)` (fixtures/rewrite/alias_generate)."""
from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from fsdp2_retrofit.analysis.facts import analyse
from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import alias_target

CASE = Path(__file__).parent.parent / "fixtures" / "rewrite" / "alias_generate"
SOURCE = (CASE / "input.py").read_text()
BUILD = "    m = model.to(device)\n    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)\n"
SAMPLE = "    print(decode(m.generate(context, max_new_tokens=20)[0].tolist()))\n"
REGISTER = 'register_fsdp_forward_method(model, "generate")'


def _rewrite(text: str) -> str:
    out = rewrite_source(text.encode(), "train.py")
    assert not out.refusals, out.refusals
    return out.code.decode()


def _variant(build: str, sample: str = SAMPLE, extra: str = "") -> str:
    assert BUILD in SOURCE and SAMPLE in SOURCE
    text = SOURCE.replace(BUILD, build).replace(SAMPLE, sample)
    return text.replace("\ndef main():", extra + "\ndef main():") if extra else text


def _sample_gated(code: str) -> bool:
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if ".generate(context" in line)
    return lines[at - 1].strip().startswith("if rank == 0")


@pytest.mark.parametrize("value", ["model.to(device)", "model.cuda()", "model.float().train()", "model"])
def test_a_name_bound_to_the_module_itself_holds_the_model(value: str):
    facts = analyse(cst.parse_module(_variant(BUILD.replace("model.to(device)", value))))
    main = next(fn for fn in facts.model_names if fn is not None and fn.name.value == "main")
    assert {"model", "m"} <= facts.model_names[main]
    assert {"model", "m"} <= facts.models[0].names[main]


def test_alias_target_follows_methods_returning_the_module():
    def target(text: str):
        return alias_target(cst.parse_expression(text))

    assert target("model.to(device).train()") == "model"
    assert target("model.module.cuda()") == "model"
    assert target("model.cuda() if gpu else model") == "model"
    assert target("model.state_dict()") is None  # a new value, not the module


@pytest.mark.parametrize("build,sample,extra", [
    (BUILD, SAMPLE, ""),  # the fixture: `m = model.to(device)`, the optimizer from m
    ("    net = model.cuda() if torch.cuda.is_available() else model\n"
     "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)\n    m = net\n", SAMPLE, ""),
    (BUILD, "    show(m, context)\n",  # a parameter handed the alias at its one call site
     "\ndef show(net, context):\n    print(decode(net.generate(context, max_new_tokens=20)[0].tolist()))\n\n"),
], ids=["to-device", "cuda-or-model", "parameter"])
def test_generate_on_an_alias_is_registered_and_not_rank_gated(build: str, sample: str, extra: str):
    code = _rewrite(_variant(build, sample, extra))
    assert REGISTER in code
    assert not _sample_gated(code)


def test_the_alias_gets_the_outcome_of_the_direct_spelling():
    """Follow the value, not the spelling: only the spelled line differs."""
    direct = SOURCE.replace(SAMPLE, SAMPLE.replace("m.generate", "model.generate"))
    assert _rewrite(SOURCE) == _rewrite(direct).replace(
        SAMPLE.replace("m.generate", "model.generate"), SAMPLE)


def test_check_follows_the_alias_into_the_rank_gate():
    """FSD110 on the output the rewrite used to make: the forward through `m` inside the rank-0 if."""
    code = (CASE / "expected.py").read_text().replace(SAMPLE, "    if rank == 0:\n    " + SAMPLE)
    findings = lint_source(code.encode(), "train.py", all_rules()).findings
    line = code.splitlines().index("    " + SAMPLE.rstrip("\n")) + 1
    assert [(f.code, f.line) for f in findings] == [("FSD110", line)], findings
    assert (CASE / "expected.py").read_text().count(SAMPLE) == 1  # and the output as generated: nothing
    assert not lint_source((CASE / "expected.py").read_bytes(), "train.py", all_rules()).findings


def test_the_optimizer_built_by_a_method_called_on_the_alias_trains_the_model():
    """`m.configure_optimizers(lr)` with `m = model.to(device)`: the method's model is `model`
    (was: refused, FSR612, `m` not recognised as holding a module)."""
    text = _variant(BUILD.replace("torch.optim.AdamW(m.parameters(), lr=1e-2)", "m.configure_optimizers(1e-2)"))
    text = text.replace("    @torch.no_grad()\n", "    def configure_optimizers(self, lr):\n"
                        "        return torch.optim.AdamW(self.parameters(), lr=lr)\n\n    @torch.no_grad()\n", 1)
    code = _rewrite(text)
    assert code.index("fully_shard(model, mesh=mesh)") < code.index("m.configure_optimizers(1e-2)")
    assert REGISTER in code


PARAMETER_MODEL = '''\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train(model):
    model = model.to("cpu")
    optimizer = model.configure_optimizers()
    for _ in range(3):
        loss = model(torch.randn(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


train(Net() if torch.cuda.is_available() else Net())  # a conditional build: not named by handed_models
'''


def test_a_model_moved_onto_its_own_name_is_not_where_it_was_built():
    """`model = model.to(device)` of a parameter is no binding of the model: the refusal
    still points at the optimizer's line and says where the model comes from."""
    out = rewrite_source(PARAMETER_MODEL.encode(), "train.py")
    assert [(r.code, r.line) for r in out.refusals] == [("FSR611", 19)], out.refusals
    assert "not built in this function" in out.refusals[0].what
