"""FSD122 unregistered-method."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.model_classes import called_methods, parameter_reads
from . import Invalid, Rule, Valid

_CLASS = (
    "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard, register_fsdp_forward_method\n"
    "class RNN(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.cell = nn.GRUCell(4, 4)\n"
    "    def init_hidden(self, n):\n        return next(self.parameters()).new_zeros(n, 4)\n"
    "    def describe(self):\n        return 'rnn'\n"
    "    def forward(self, x, h):\n        return self.cell(x, h)\n"
)


class UnregisteredMethod(Rule):
    """Checks for a method of a sharded model that reads its parameters, called outside forward without registration.

    ## What it does
    Flags `model.method(...)` where `model` is sharded with `fully_shard`, `method` is
    a method of the model's own class (in the script or a module beside it) that reads
    the module's parameters (`next(self.parameters())`, `self.head.weight.new_zeros(...)`,
    `.data`, `.clone()`), and the script never calls
    `register_fsdp_forward_method(model, "method")`.

    ## Why is this bad?
    FSDP2 gathers the parameters only around `forward` (its hooks run in
    `model(...)`). Anywhere else each parameter is a DTensor holding this rank's
    shard: a tensor built from it (`new_zeros`, `clone`) is a DTensor too, and mixing
    it with the plain activations of the forward raises "got mixed torch.Tensor and
    DTensor", or its shape is the shard's, not the parameter's.

    ## Example
    ```python
    fully_shard(model)
    hidden = model.init_hidden(batch)
    ```

    ## Use instead
    ```python
    fully_shard(model)
    register_fsdp_forward_method(model, "init_hidden")
    hidden = model.init_hidden(batch)
    ```

    ## Fix safety
    No automatic fix here; `fsdp2-retrofit rewrite` registers such methods.
    """

    CODE = "FSD122"
    NAME = "unregistered-method"
    MESSAGE = (
        "`{target}.{method}()` reads the parameters of sharded `{root}` outside forward (`{read}`): "
        "they are DTensor shards there; call `register_fsdp_forward_method({root}, \"{method}\")` after fully_shard"
    )
    TRIGGERS = ("parameters", "weight", "bias")
    VALID = (
        Valid(_CLASS + "model = RNN()\nfully_shard(model)\nregister_fsdp_forward_method(model, 'init_hidden')\n"
              "h = model.init_hidden(2)\n"),
        Valid(_CLASS + "model = RNN()\nfully_shard(model)\nprint(model.describe())\n"),  # no parameter read
        Valid(_CLASS + "model = RNN()\nh = model.init_hidden(2)\n"),  # not sharded
        Valid(  # registered under another name for the same module
            _CLASS + "model = RNN()\nfully_shard(model)\nm = model.to('cpu')\n"
            "register_fsdp_forward_method(m, 'init_hidden')\nh = model.init_hidden(2)\n"
        ),
    )
    INVALID = (
        Invalid(_CLASS + "model = RNN()\nfully_shard(model)\nh = model.init_hidden(2)\n", line=16),
        Invalid(  # built with .to(device), inside main()
            _CLASS + "def main():\n    model = RNN().to('cpu')\n    fully_shard(model)\n    for x in data:\n"
            "        h = model.init_hidden(x.size(0))\n        model(x, h).sum().backward()\n",
            line=18,
        ),
        Invalid(  # an alias: `.to()` returns the module itself
            _CLASS + "model = RNN()\nfully_shard(model)\nm = model.to('cpu')\nh = m.init_hidden(2)\n", line=17,
        ),
        Invalid(  # a parameter handed the sharded module
            _CLASS + "def start(net):\n    return net.init_hidden(2)\nmodel = RNN()\nfully_shard(model)\n"
            "h = start(model)\n",
            line=15,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard:
            return

        def sites_of(receiver, at) -> set:
            """The fully_shard calls of the whole module `receiver` holds at `at`, followed
            through aliases (`m = model.to(device)`) and parameters handed it."""
            found = shards.fsdp2_root(receiver, at)
            return {id(s.call) for s in shards.sites_for(*found)} if found is not None else set()

        registered = set()
        for call in ctx.nodes(cst.Call):
            func = call.func
            name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""
            if name == "register_fsdp_forward_method" and len(call.args) >= 2:
                method = call.args[1].value
                if isinstance(method, cst.SimpleString):
                    registered |= {(s, method.evaluated_value) for s in sites_of(call.args[0].value, call)}
        done = set()
        for site in shards.sites:
            if site.legacy or not site.whole or site.root in done:
                continue
            infos = ctx.root_classes(site)  # a class chosen at run time: any of them
            if not infos:
                continue
            done.add(site.root)

            def holds(receiver, at, site=site) -> bool:
                return id(site.call) in sites_of(receiver, at)

            flagged = set()
            for info in infos:
                for method in called_methods(holds, info, ctx.resolver):
                    if (id(site.call), method) in registered or method in flagged:
                        continue
                    reads = parameter_reads(info.methods[method], info)
                    if not reads:
                        continue
                    flagged.add(method)
                    read = _code(reads[0][0])
                    read = read if len(read) <= 40 else read[:37] + "..."
                    for call in ctx.nodes(cst.Call):
                        func = call.func
                        if isinstance(func, cst.Attribute) and func.attr.value == method and holds(func.value, call):
                            yield call, {"target": _code(func.value), "root": site.root, "method": method,
                                         "read": read}, None


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
