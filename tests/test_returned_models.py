"""A helper that builds the model and returns it (`model, optimizer = build(lr)`): the
launch and the teardown go in the scope that receives the model, fully_shard and the mesh
stay in the helper; a returned model the rewrite cannot follow is refused (FSR404)."""
from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from fsdp2_retrofit.analysis.returns import names_out, returned_names
from fsdp2_retrofit.rewrite.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import Resolver

CASE = Path(__file__).parent.parent / "fixtures" / "rewrite" / "helper_returns_model_optimizer"
SOURCE = (CASE / "input.py").read_text()
CALL = "    model, optimizer = build(1e-2)\n"


def _rewrite(text: str):
    return rewrite_source(text.encode(), "train.py")


def _function(code: str, name: str) -> str:
    """The source of top-level function `name` of `code`."""
    return next(cst.Module([s]).code for s in cst.parse_module(code).body
                if isinstance(s, cst.FunctionDef) and s.name.value == name)


def test_launch_and_teardown_go_where_the_model_is_received():
    out = _rewrite(SOURCE)
    assert not out.refusals, out.refusals
    code = out.code.decode()
    build, main = _function(code, "build"), _function(code, "main")
    assert "destroy_process_group" not in build and "init_process_group" not in build  # was: teardown before `return`
    assert "init_device_mesh(" in build and "fully_shard(model, mesh=mesh)" in build
    assert main.index("init_process_group") < main.index("build(1e-2)")
    assert main.rstrip().endswith("dist.destroy_process_group()")
    assert "dcp.save(get_model_state_dict(model)" in main  # the caller's `model` is the sharded one


def test_the_model_is_followed_through_two_helpers():
    text = SOURCE.replace("def main():", "def setup(lr):\n    model, optimizer = build(lr)\n    return model, optimizer\n\n\n"
                          "def main():").replace(CALL, "    model, optimizer = setup(1e-2)\n")
    code = _rewrite(text).code.decode()
    setup, main = _function(code, "setup"), _function(code, "main")
    assert "dist." not in setup
    assert main.index("init_process_group") < main.index("setup(1e-2)") < main.index("destroy_process_group")
    assert "dcp.save(get_model_state_dict(model)" in main


@pytest.mark.parametrize("change", [
    CALL + "    _, _ = build(1e-3)\n",  # called twice
    "    built = build(1e-2)\n    model, optimizer = built\n",  # not unpacked at the call
], ids=["called-twice", "kept-as-a-tuple"])
def test_a_returned_model_that_cannot_be_followed_is_refused(change):
    text = SOURCE.replace(CALL, change)
    out = _rewrite(text)
    assert [r.code for r in out.refusals] == ["FSR404"], out.refusals
    assert out.refusals[0].line == text.splitlines().index("    model = Net()") + 1
    assert out.code == text.encode()


def test_an_optimizer_built_inside_the_returned_tuple_is_named():
    text = SOURCE.replace("    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n    return model, optimizer\n",
                          "    return model, torch.optim.AdamW(model.parameters(), lr=lr)\n")
    out = _rewrite(text)
    assert [r.code for r in out.refusals] == ["FSR612"], out.refusals
    assert out.refusals[0].line == text.splitlines().index("    return model, torch.optim.AdamW(model.parameters(), lr=lr)") + 1
    assert "inside the tuple it returns" in out.refusals[0].what


def _names(code: str, wanted):
    module = cst.parse_module(code)
    resolver = Resolver(module)
    fn = next(s for s in module.body if isinstance(s, cst.FunctionDef))
    call = resolver.nodes(cst.Call)[-1]
    return returned_names(fn, wanted), names_out(resolver, call, fn, wanted)


def test_a_name_is_followed_only_where_every_return_gives_it_back_at_one_place():
    same = "def f(a):\n    if a:\n        return m, o\n    return m, o\nx, y = f(1)\n"
    assert _names(same, {"m", "o"}) == ({"m": 0, "o": 1}, {"x": "m", "y": "o"})
    moved = "def f(a):\n    if a:\n        return m, o\n    return o, m\nx, y = f(1)\n"
    assert _names(moved, {"m", "o"}) == ({}, {})
    alone = "def f():\n    return m\nx = f()\n"
    assert _names(alone, {"m"}) == ({"m": -1}, {"x": "m"})
    arity = "def f():\n    return m, o\nx = f()\n"
    assert _names(arity, {"m"})[1] == {}
