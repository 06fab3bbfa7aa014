"""A helper that builds the model and returns it (`model, optimizer = build(lr)`): the
launch and the teardown go in the scope that receives the model, fully_shard and the mesh
stay in the helper; a returned model the rewrite cannot follow is refused (FSR404)."""
from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from fsdp2_retrofit.analysis.returns import names_out, returned_names
from fsdp2_retrofit.pipeline import rewrite_source
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


def test_an_optimizer_built_inside_the_returned_tuple_is_named_and_built_after_fully_shard():
    """`return model, torch.optim.AdamW(...)` (fixture helper_returns_inline_optimizer runs it)."""
    text = SOURCE.replace("    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n    return model, optimizer\n",
                          "    return model, torch.optim.AdamW(model.parameters(), lr=lr)\n")
    out = _rewrite(text)
    build = _function(out.code.decode(), "build")
    assert build.index("fully_shard(model, mesh=mesh)") < build.index(
        "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n    return model, optimizer\n")
    [named] = [c for c in out.changes if c.code == "returns" and "bind the optimizer" in c.what]
    assert named.line == text.splitlines().index("    return model, torch.optim.AdamW(model.parameters(), lr=lr)") + 1


def test_two_optimizers_built_inside_the_returned_tuple_are_refused_naming_the_first():
    text = SOURCE.replace("    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n    return model, optimizer\n",
                          "    return model, torch.optim.AdamW(model.parameters(), lr=lr), "
                          "torch.optim.SGD(model.parameters(), lr=lr)\n").replace(
        "model, optimizer = build(1e-2)", "model, optimizer, _ = build(1e-2)")
    out = _rewrite(text)
    assert [r.code for r in out.refusals] == ["FSR612"], out.refusals
    assert "inside the tuple it returns" in out.refusals[0].what
    assert out.code == text.encode()


def _names(code: str, wanted):
    module = cst.parse_module(code)
    resolver = Resolver(module)
    fn = next(s for s in module.body if isinstance(s, cst.FunctionDef))
    call = resolver.nodes(cst.Call)[-1]
    return returned_names(resolver, fn, wanted), names_out(resolver, call, fn, wanted)


def test_a_name_is_followed_only_where_every_return_gives_it_back_at_one_place():
    same = "def f(a):\n    if a:\n        return m, o\n    return m, o\nx, y = f(1)\n"
    assert _names(same, {"m", "o"}) == ({"m": 0, "o": 1}, {"x": "m", "y": "o"})
    moved = "def f(a):\n    if a:\n        return m, o\n    return o, m\nx, y = f(1)\n"
    assert _names(moved, {"m", "o"}) == ({}, {})
    alone = "def f():\n    return m\nx = f()\n"
    assert _names(alone, {"m"}) == ({"m": -1}, {"x": "m"})
    arity = "def f():\n    return m, o\nx = f()\n"
    assert _names(arity, {"m"})[1] == {}


@pytest.mark.parametrize("returned", [
    '    return {"model": model, "optimizer": optimizer}\n',  # a dict
    '    return model.to("cpu"), optimizer\n',  # through a method that returns the model
])
def test_a_model_returned_in_another_shape_is_refused(returned):
    """Before: the teardown went before the helper's `return` and the caller trained on a
    destroyed process group."""
    text = SOURCE.replace("    return model, optimizer\n", returned)
    if "{" in returned:
        text = text.replace(CALL, '    parts = build(1e-2)\n    model, optimizer = parts["model"], parts["optimizer"]\n')
    out = _rewrite(text)
    assert [r.code for r in out.refusals] == ["FSR404"], out.refusals
    assert out.code == text.encode()


TRAIN_AND_RETURN = SOURCE.replace(CALL, "    torch.manual_seed(0)\n    model = Net()\n"
                                  "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)\n")
TRAIN_AND_RETURN = TRAIN_AND_RETURN[:TRAIN_AND_RETURN.index("def build(lr):")] + TRAIN_AND_RETURN[
    TRAIN_AND_RETURN.index("def main():"):]


@pytest.mark.parametrize("returned, computed_first", [
    ("    return evaluate(model, data)\n", True),  # a forward of the sharded model: needs the group
    ("    return args.out\n", False),
])
def test_a_returned_value_that_calls_anything_is_computed_before_the_teardown(returned, computed_first):
    text = TRAIN_AND_RETURN.replace("    torch.save(model.state_dict(), args.out)\n",
                                    "    torch.save(model.state_dict(), args.out)\n" + returned)
    text = text.replace("def main():", "def evaluate(model, data):\n    x, y = data.tensors\n"
                        "    return nn.functional.cross_entropy(model(x), y).item()\n\n\ndef main():")
    out = _rewrite(text)
    assert not out.refusals, out.refusals
    main = _function(out.code.decode(), "main")
    tail = [line.strip() for line in main.rstrip().splitlines()[-3:]]
    if computed_first:
        assert tail == ["result = evaluate(model, data)", "dist.destroy_process_group()", "return result"]
    else:
        assert tail[-2:] == ["dist.destroy_process_group()", "return args.out"]


LOADERS = (CASE.parent / "helper_returns_loaders" / "input.py").read_text()


def test_a_returned_loader_gets_set_epoch_in_the_callers_epoch_loop():
    code = _rewrite(LOADERS).code.decode()
    main = _function(code, "main")
    loop = main.index("for epoch in range(args.epochs):")
    assert main.index("train_loader.sampler.set_epoch(epoch)", loop) < main.index("for x, y in train_loader:")
    assert "set_epoch" not in _function(code, "build_loaders")


def test_a_loader_helper_called_twice_sets_the_epoch_of_the_loader_the_loop_reads():
    """The loop's `train_loader` holds the first call's loader only (followed by value), and that
    loader's own `.sampler` is the DistributedSampler the helper gives it: set_epoch goes there,
    however often the helper is called."""
    text = LOADERS.replace("    train_loader, val_loader = build_loaders(args.batch_size)\n",
                           "    train_loader, val_loader = build_loaders(args.batch_size)\n"
                           "    _, _ = build_loaders(args.batch_size)\n")
    out = _rewrite(text)
    code = out.code.decode()
    main = _function(code, "main")
    loop = main.index("for epoch in range(args.epochs):")
    assert main.index("train_loader.sampler.set_epoch(epoch)", loop) < main.index("for x, y in train_loader:")
    assert "set_epoch" not in _function(code, "build_loaders")
    assert not any("set_epoch" in a.what for a in out.attention), out.attention


def test_a_pass_over_either_of_two_loaders_keeps_the_attention_item():
    """`loader = train_loader if ... else other`: the loop's reader may hold two loaders, so no
    one `.sampler` is known to be the one read: no set_epoch, the attention item stays."""
    text = LOADERS.replace("    train_loader, val_loader = build_loaders(args.batch_size)\n",
                           "    train_loader, val_loader = build_loaders(args.batch_size)\n"
                           "    train_loader = train_loader if args.epochs else build_loaders(args.batch_size)[0]\n")
    out = _rewrite(text)
    assert "set_epoch" not in out.code.decode()
    assert any("set_epoch" in a.what for a in out.attention), out.attention


OWN_GROUP = SOURCE.replace("import torch\n", "import torch\nimport torch.distributed as dist\n", 1).replace(
    "    torch.save(model.state_dict(), args.out)\n",
    "    torch.save(model.state_dict(), args.out)\n    dist.destroy_process_group()\n")
START = '    dist.init_process_group("gloo")\n'


def test_a_script_starting_its_own_group_keeps_it_and_the_helper_gets_the_mesh():
    text = OWN_GROUP.replace(CALL, START + CALL)
    out = _rewrite(text)
    assert not out.refusals, out.refusals
    code = out.code.decode()
    assert code.count("init_process_group") == 1 and code.count("destroy_process_group") == 1
    assert "mesh = init_device_mesh(" in _function(code, "build")


def test_a_helper_called_before_the_scripts_own_group_starts_is_refused():
    text = OWN_GROUP.replace(CALL, CALL + START)
    out = _rewrite(text)
    assert [r.code for r in out.refusals] == ["FSR402"], out.refusals


@pytest.mark.parametrize("call", ["    main()\n", "    fire.Fire(main)\n"], ids=["discarded", "not-called-by-name"])
def test_a_returned_model_nothing_receives_keeps_the_launch_where_it_is_built(call):
    """`def main(): ...; return model` with `main()` as a statement (or run by a library):
    the launch and teardown stay in main, as for any model built there."""
    text = TRAIN_AND_RETURN.replace("    torch.save(model.state_dict(), args.out)\n",
                                    "    torch.save(model.state_dict(), args.out)\n    return model\n")
    text = text.replace('if __name__ == "__main__":\n    main()\n', 'if __name__ == "__main__":\n' + call)
    if "fire" in call:
        text = "import fire\n" + text
    out = _rewrite(text)
    assert not out.refusals, out.refusals
    main = _function(out.code.decode(), "main")
    assert "init_process_group" in main
    assert [line.strip() for line in main.rstrip().splitlines()[-2:]] == ["dist.destroy_process_group()", "return model"]
