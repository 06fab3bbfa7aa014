"""Optimizers built the way people write them (issue 15): a torch optimizer built inline
as the argument of a user wrapper class, and one built by a method of the model from its
own parameters. Analysis on small parsed scripts; refusals name the real blocker."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst

from fsdp2_retrofit.analysis.facts import analyse
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import code

HEAD = dedent("""\
    import torch
    import torch.nn as nn
    import torch.optim as optim


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

        def configure_optimizers(self, lr):
            groups = [{"params": [p for n, p in self.named_parameters() if p.dim() >= 2], "weight_decay": 0.1},
                      {"params": [p for n, p in self.named_parameters() if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=lr)


    class Scheduled:
        def __init__(self, optimizer, warmup):
            self._optimizer = optimizer
            self.warmup = warmup

        def step_and_update_lr(self):
            self._optimizer.step()

        def zero_grad(self):
            self._optimizer.zero_grad()


    """)

LOOP = dedent("""\
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step_and_update_lr()
    """)


def facts_of(source: str):
    return analyse(cst.parse_module(source), "train.py")


def rewrite(source: str):
    return rewrite_source(source.encode(), "train.py", RetrofitOptions())


def test_an_inline_optimizer_in_a_wrapper_trains_the_model():
    facts = facts_of(HEAD + "model = Net()\nopt = Scheduled(optim.Adam(model.parameters(), eps=1e-9), 4000)\n" + LOOP)
    (site,) = facts.optimizers
    assert (site.name, site.models, site.inner) == ("opt", ["model"], "_optimizer")
    assert code(site.call) == "optim.Adam(model.parameters(), eps=1e-9)"
    assert code(site.wrapper.func) == "Scheduled"
    assert facts.optimizer_names[None] == {"opt": "model", "opt._optimizer": "model"}


def test_the_wrapper_and_its_optimizer_follow_a_call():
    source = HEAD + dedent("""\
        def train(net, optimizer):
            optimizer.zero_grad()
            net(torch.ones(2, 4)).sum().backward()
            optimizer.step_and_update_lr()
            torch.save(optimizer._optimizer.state_dict(), "opt.pt")


        def main():
            model = Net()
            opt = Scheduled(optim.Adam(model.parameters()), warmup=10)
            train(model, opt)
        """)
    facts = facts_of(source)
    train = next(fn for fn in facts.optimizer_names if fn is not None and fn.name.value == "train")
    assert facts.optimizer_names[train] == {"optimizer": "net", "optimizer._optimizer": "net"}
    out = rewrite(source).code.decode()
    assert "get_optimizer_state_dict(net, optimizer._optimizer)" in out
    assert out.index("fully_shard(model, mesh=mesh)") < out.index("opt = Scheduled(")


def test_fully_shard_goes_before_the_whole_wrapper_statement():
    source = HEAD + "model = Net()\nopt = Scheduled(\n    optim.Adam(model.parameters()),\n    4000)\n" + LOOP
    result = rewrite(source)
    assert not result.refusals, result.refusals
    assert "fully_shard(model, mesh=mesh)\nopt = Scheduled(\n    optim.Adam(model.parameters()),\n" in result.code.decode()


def test_a_gated_wrapper_step_is_the_accumulation_step():
    loop = dedent("""\
        for i in range(8):
            loss = model(torch.randn(8, 4)).pow(2).mean() / 2
            loss.backward()
            if (i + 1) % 2 == 0:
                opt.step_and_update_lr()
                opt.zero_grad()
        """)
    out = rewrite(HEAD + "model = Net()\nopt = Scheduled(optim.Adam(model.parameters()), 4000)\n" + loop).code.decode()
    assert ("    model.set_requires_gradient_sync((i + 1) % 2 == 0)\n"
            "    model.set_reshard_after_backward((i + 1) % 2 == 0)\n    loss.backward()") in out


def test_a_torch_scheduler_around_an_inline_optimizer_is_no_wrapper():
    source = HEAD + "model = Net()\nsched = torch.optim.lr_scheduler.StepLR(optim.SGD(model.parameters(), lr=0.1), 2)\n"
    assert facts_of(source).optimizers == []


def test_a_wrapper_that_does_not_keep_the_optimizer_is_refused_at_its_line():
    source = HEAD.replace("self._optimizer = optimizer", "self._optimizer = None") + (
        "model = Net()\nopt = Scheduled(optim.Adam(model.parameters()), 4000)\n" + LOOP)
    assert facts_of(source).optimizers == []
    (refusal,) = rewrite(source).refusals
    assert (refusal.code, refusal.line) == ("FSR612", HEAD.count("\n") + 2)
    assert "`Scheduled(...)` holds the optimizer `optim.Adam(...)`, but its __init__ does not keep" in refusal.what


def test_an_unread_wrapper_is_followed_and_said():
    """Its class comes from an installed package: fully_shard before it, reported."""
    source = "from schedules import Scheduled\n" + HEAD[:HEAD.index("class Scheduled")] + (
        "model = Net()\nopt = Scheduled(optim.Adam(model.parameters()), 4000)\n" + LOOP)
    result = rewrite(source)
    assert not result.refusals, result.refusals
    assert "fully_shard(model, mesh=mesh)\nopt = Scheduled(" in result.code.decode()
    assert any("`opt` is `Scheduled(...)` around the optimizer" in a.what for a in result.attention)


def test_a_state_dict_through_an_unread_wrapper_is_refused_at_its_line():
    source = "from schedules import Scheduled\n" + HEAD[:HEAD.index("class Scheduled")] + (
        "model = Net()\nopt = Scheduled(optim.Adam(model.parameters()), 4000)\n" + LOOP
        + "torch.save(opt.inner.state_dict(), 'opt.pt')\n")
    (refusal,) = rewrite(source).refusals
    assert (refusal.code, refusal.line) == ("FSR612", source.count("\n"))
    assert refusal.what.startswith("`opt.inner.state_dict()`: the optimizer is held by `Scheduled(...)`")


def test_a_wrapper_of_an_unknown_model_names_the_model_binding():
    source = HEAD + "from mylib import get_model\nmodel = get_model()\nopt = Scheduled(optim.Adam(model.parameters()), 4000)\n"
    (refusal,) = rewrite(source).refusals
    assert refusal.line == HEAD.count("\n") + 2
    assert "`model` (trained by the optimizer at line" in refusal.what


def test_a_model_method_builds_the_optimizer_through_the_ddp_alias():
    source = HEAD + dedent("""\
        ddp = False
        model = Net()
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        raw_model = model.module if ddp else model
        opt = raw_model.configure_optimizers(lr=0.1)
        """)
    (site,) = facts_of(source).optimizers
    assert (site.name, site.models, site.method.name.value) == ("opt", ["model"], "configure_optimizers")
    out = rewrite(source + LOOP.replace("step_and_update_lr", "step")).code.decode()
    assert out.index("fully_shard(model, mesh=mesh)") < out.index("opt = raw_model.configure_optimizers")


def test_a_model_method_that_does_not_read_its_own_parameters_is_not_its_optimizer():
    source = HEAD.replace("self.named_parameters()", "extra.named_parameters()") + (
        "extra = nn.Linear(2, 2)\nmodel = Net()\nopt = model.configure_optimizers(0.1)\n")
    assert facts_of(source).optimizers == []


def test_a_model_method_building_lbfgs_is_refused():
    source = HEAD.replace("torch.optim.AdamW(groups, lr=lr)", "torch.optim.LBFGS(self.parameters(), lr=lr)") + (
        "model = Net()\nopt = model.configure_optimizers(0.1)\n" + LOOP.replace("step_and_update_lr", "step"))
    (refusal,) = rewrite(source).refusals
    assert refusal.code == "FSR621" and "configure_optimizers()" in refusal.what


def test_a_model_method_that_can_build_zero_is_flagged():
    assert "        return torch.optim.AdamW(groups, lr=lr)\n" in HEAD
    source = HEAD.replace(
        "        return torch.optim.AdamW(groups, lr=lr)",
        "        if lr < 0:\n"
        "            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW)\n"
        "        return torch.optim.AdamW(groups, lr=lr)",
    ).replace("import torch.optim as optim\n", "import torch.optim as optim\n"
              "from torch.distributed.optim import ZeroRedundancyOptimizer\n")
    result = rewrite(source + "model = Net()\nopt = model.configure_optimizers(0.1)\n"
                     + LOOP.replace("step_and_update_lr", "step"))
    assert not result.refusals, result.refusals
    assert any("ZeroRedundancyOptimizer" in a.what for a in result.attention)


def _classmethod_factory(returned: str) -> str:
    return HEAD.replace("    def configure_optimizers", "    @classmethod\n    def build(cls):\n"
                        f"        return {returned}\n\n    def configure_optimizers") + dedent("""\
        def main(ddp):
            model = Net.build()
            if ddp:
                model = torch.nn.parallel.DistributedDataParallel(model)
            raw_model = model.module if ddp else model
            opt = raw_model.configure_optimizers(0.1)
        """)


def test_a_model_from_a_class_method_factory_is_its_class():
    """`Net.build()` returning `cls()` builds a Net, like its constructor (was FSR611)."""
    source = _classmethod_factory("cls()")
    result = rewrite(source)
    assert not result.refusals
    out = result.code.decode()
    assert out.index("model = Net.build()") < out.index("fully_shard(model, mesh=mesh)") < out.index(
        "opt = raw_model.configure_optimizers(0.1)")


def test_a_model_from_a_class_method_returning_something_else_is_named_as_the_blocker():
    source = _classmethod_factory("cls.cached")
    (refusal,) = rewrite(source).refusals
    line = source.splitlines().index("    model = Net.build()") + 1
    assert (refusal.code, refusal.line) == ("FSR611", line), refusal
    assert "`model` (whose configure_optimizers() at line" in refusal.what
    assert "is bound by `Net.build()`, not recognised as building an nn.Module" in refusal.what


def test_an_alias_whose_branches_name_different_models_is_not_followed():
    source = HEAD + dedent("""\
        ddp = False
        model = Net()
        other = Net()
        raw_model = other if ddp else model
        opt = raw_model.configure_optimizers(lr=0.1)
        """)
    assert facts_of(source).optimizers == []


def test_a_resume_through_the_wrapper_loads_the_torch_optimizer():
    source = "import os\n" + HEAD + dedent("""\
        model = Net()
        opt = Scheduled(optim.Adam(model.parameters()), 4000)
        if os.path.exists("ckpt.pt"):
            ckpt = torch.load("ckpt.pt")
            model.load_state_dict(ckpt["model"])
            opt._optimizer.load_state_dict(ckpt["optimizer"])
        """) + LOOP + 'torch.save({"model": model.state_dict(), "optimizer": opt._optimizer.state_dict()}, "ckpt.pt")\n'
    result = rewrite(source)
    assert not result.refusals, result.refusals
    out = result.code.decode()
    assert ('"optimizer": get_optimizer_state_dict(model, opt._optimizer),\n    }\n    if os.path.isdir("ckpt.pt"):'
            '  # a DCP checkpoint directory: this script\'s own save\n        dcp.load(ckpt') in out
    # a single-GPU file's numbered state is named by the order of the torch optimizer's groups
    assert 'for group in opt._optimizer.param_groups for p in group["params"]]' in out
    assert 'set_optimizer_state_dict(model, opt._optimizer, ckpt["optimizer"], options=ckpt_options)' in out
    assert '"optimizer": get_optimizer_state_dict(model, opt._optimizer)}, checkpoint_id="ckpt.pt")' in out


# --- an optimizer built by a function of the script ----------------------------------

FACTORY = dedent("""\
    import torch
    import torch.nn as nn


    def make_optimizer(model, lr):
    {body}


    def main():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = make_optimizer(model, 0.1)
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


    main()
    """)


def _factory(body: str) -> str:
    return FACTORY.replace("{body}", "\n".join("    " + line for line in dedent(body).strip().splitlines()))


def test_a_function_handed_the_model_that_returns_its_optimizer_builds_it():
    source = _factory("return torch.optim.SGD(model.parameters(), lr=lr)")
    facts = analyse(cst.parse_module(source))
    [opt] = facts.optimizers
    assert (opt.name, opt.models, opt.method.name.value) == ("opt", ["model"], "make_optimizer")
    result = rewrite_source(source.encode(), "train.py")
    assert not result.refusals
    out = result.code.decode()
    assert out.index("fully_shard(model") < out.index("opt = make_optimizer(model, 0.1)")


def test_param_groups_and_a_named_result_are_followed():
    source = _factory("""
        groups = [{"params": [p for n, p in model.named_parameters() if p.dim() >= 2]},
                  {"params": [p for n, p in model.named_parameters() if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=lr)
        return optimizer
    """)
    opt = next(o for o in analyse(cst.parse_module(source)).optimizers if o.name == "opt")
    assert opt.models == ["model"] and opt.method.name.value == "make_optimizer"
    assert not rewrite_source(source.encode(), "train.py").refusals


def test_param_groups_sorted_by_module_type_are_followed():
    """The minGPT shape: `for mn, m in model.named_modules(): for pn, p in m.named_parameters():` sorts
    names into decay / no_decay sets, then groups from `model.named_parameters()`: `m` is a part of
    the model handed in, read only (it was FSR612: `m` counted as a second model the function closes over)."""
    source = _factory("""
        decay, no_decay = set(), set()
        for mn, m in model.named_modules():
            for pn, p in m.named_parameters():
                full = f"{mn}.{pn}" if mn else pn
                if pn.endswith("weight") and isinstance(m, nn.Linear):
                    decay.add(full)
                else:
                    no_decay.add(full)
        params = {pn: p for pn, p in model.named_parameters()}
        groups = [{"params": [params[n] for n in sorted(decay)], "weight_decay": 0.1},
                  {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr)
    """)
    opt = next(o for o in analyse(cst.parse_module(source)).optimizers if o.name == "opt")
    assert opt.models == ["model"] and opt.method.name.value == "make_optimizer"
    result = rewrite_source(source.encode(), "train.py")
    assert not result.refusals, result.refusals
    out = result.code.decode()
    assert out.index("fully_shard(model") < out.index("opt = make_optimizer(model, 0.1)")


def test_optimizers_a_function_builds_from_its_parameter_train_the_model_it_is_handed():
    """Not a factory (two optimizers, or it returns something else), but each optimizer in it
    is built from the parameters of the module every call hands it (followed by value): the
    module is sharded before the call, so they are built from the sharded parameters."""
    for body in [
        "a = torch.optim.SGD(model.parameters(), lr=lr)\nb = torch.optim.Adam(model.parameters())\nreturn a",
        "built = torch.optim.SGD(model.parameters(), lr=lr)\nreturn None",
    ]:
        source = _factory(body)
        result = rewrite_source(source.encode(), "train.py")
        assert not result.refusals, body
        out = result.code.decode()
        assert out.index("fully_shard(model, mesh=mesh)") < out.index("opt = make_optimizer(model, 0.1)"), body


def test_a_factory_that_does_more_with_the_model_is_not_followed():
    for body in [
        "model.to('cpu')\nreturn torch.optim.SGD(model.parameters(), lr=lr)",  # moves it: not only reads
        "for p in model.parameters():\n    p.requires_grad_(False)\nreturn torch.optim.SGD(model.fc.parameters(), lr=lr)",
    ]:
        source = _factory(body)
        assert "opt" not in [o.name for o in analyse(cst.parse_module(source)).optimizers], body
        result = rewrite_source(source.encode(), "train.py")
        assert result.code == source.encode()
        [refusal] = result.refusals  # named where the optimizer is asked for, with the function that builds it
        assert refusal.code == "FSR612" and "builds the optimizer in make_optimizer()" in refusal.what, refusal
        assert refusal.line == source.splitlines().index("    opt = make_optimizer(model, 0.1)") + 1


BRANCH_BUILD = '''\
import argparse

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.resume is None:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        checkpoint = torch.load(args.resume)
        model = checkpoint["model"]
        optimizer = checkpoint["optimizer"]
    model = model.to(device)
    for step in range(5):
        loss = model(torch.randn(16, 8, device=device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save({"model": model, "optimizer": optimizer}, "ckpt.pt")


main()
'''


def test_an_optimizer_built_in_a_branch_before_the_model_is_sharded_is_refused_at_its_line():
    """The model and its optimizer made in one branch of `if resume is None:` / `else:` (the image
    captioning tutorial's shape), the model placed after the if/else, where fully_shard goes: no stage
    moves the optimizer out of the branch, so it would keep the unsharded parameters and the model
    would never update. Refused at the optimizer's line (was: rewritten, silently never training)."""
    from fsdp2_retrofit.pipeline import rewrite_source

    result = rewrite_source(BRANCH_BUILD.encode(), "train.py")
    line = BRANCH_BUILD.splitlines().index("        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)") + 1
    assert [(r.code, r.line) for r in result.refusals] == [("FSR629", line)]
    assert "never updates" in result.refusals[0].why
    assert result.code == BRANCH_BUILD.encode()


def test_an_if_else_picking_the_optimizer_after_the_build_is_sharded_before():
    """fixtures/rewrite/optimizer_picked_in_branch: the placement after the if/else does not pull
    fully_shard past the optimizer's build."""
    from fsdp2_retrofit.pipeline import rewrite_source

    text = BRANCH_BUILD.replace('''    if args.resume is None:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        checkpoint = torch.load(args.resume)
        model = checkpoint["model"]
        optimizer = checkpoint["optimizer"]
''', '''    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    if args.resume is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
''').replace('    torch.save({"model": model, "optimizer": optimizer}, "ckpt.pt")\n', "")
    result = rewrite_source(text.encode(), "train.py")
    assert not result.refusals, result.refusals
    out = result.code.decode()
    assert out.index("fully_shard(model, mesh=mesh)") < out.index("    if args.resume is None:")
