"""launch: make the script a torchrun program (process group, device, mesh)."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.syntax.names import assigned_names, calls_in, is_main_guard, names_in, walk
from fsdp2_retrofit.analysis.frameworks import training_framework
from fsdp2_retrofit.analysis.taken_names import foreign_binding
from fsdp2_retrofit.analysis.process_group import process_group
from fsdp2_retrofit.analysis.downloads import download_sites
from fsdp2_retrofit.analysis.rank_local import every_rank_binds, rank_local_names
from fsdp2_retrofit.analysis.sibling_loaders import sibling_loaders
from fsdp2_retrofit.rewrite.link import outside_modules
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

# Under torchrun (RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous address in the
# environment) the group spans every rank; run as plain `python train.py` it is a
# group of that one process (an in-memory store: no address, no port), so the
# script can still be debugged like the original and trains exactly like it.
PREAMBLE = """\
{local_rank} = int(os.environ.get("LOCAL_RANK", 0))
if torch.cuda.is_available():
    torch.cuda.set_device({local_rank})
if "RANK" in os.environ:  # launched by torchrun
    dist.init_process_group({backend} if torch.cuda.is_available() else "gloo")
else:  # plain `python train.py`: a process group of this one process
    dist.init_process_group(
        {backend} if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
{rank}, {world_size} = dist.get_rank(), dist.get_world_size()
"""
MESH = """{mesh} = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", ({world_size},))\n"""
# HSDP: a named 2-D mesh, replicas x shards; fully_shard replicates over dim 0 and shards over dim 1
HSDP_MESH = """\
assert {world_size} % {replicas} == 0, f"HSDP: {{{world_size}}} ranks do not split into {replicas} replica groups: launch a multiple of {replicas}"
{mesh} = init_device_mesh(
    "cuda" if torch.cuda.is_available() else "cpu",
    ({replicas}, {world_size} // {replicas}),
    mesh_dim_names=("replicate", "shard"),
)
"""

# FSDP1's HYBRID_SHARD: shard within a node (its LOCAL_WORLD_SIZE ranks), replicate across the nodes
NODE_MESH = """\
{mesh} = init_device_mesh(
    "cuda" if torch.cuda.is_available() else "cpu",
    ({world_size} // int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])),
    mesh_dim_names=("replicate", "shard"),
)
"""
# FSDP1's NO_SHARD: every rank a replica of its own (a shard dimension of 1): whole parameters, gradients all-reduced
REPLICA_MESH = """\
{mesh} = init_device_mesh(
    "cuda" if torch.cuda.is_available() else "cpu",
    ({world_size}, 1),
    mesh_dim_names=("replicate", "shard"),
)
"""


def mesh_template(options) -> str:
    """The mesh statement(s) the options ask for (formatted with mesh, world_size, replicas)."""
    if options.hsdp:
        return HSDP_MESH
    return {"per_node": NODE_MESH, "replicate": REPLICA_MESH}.get(options.mesh_layout, MESH)


def mesh_words(options) -> str:
    """How the mesh is described in a change line."""
    if options.hsdp:
        return f"2-D (replicate, shard) device mesh of {options.hsdp} replicas for HSDP"
    return {"per_node": "2-D (replicate, shard) device mesh, one replica per node (LOCAL_WORLD_SIZE ranks shard)",
            "replicate": "2-D (replicate, shard) device mesh with a shard dimension of 1 (every rank a replica)",
            }.get(options.mesh_layout, "1-D device mesh")


class LaunchDistributedCommand(RetrofitStage):
    DESCRIPTION = "Start a process group and a device mesh where the model is built; tear it down at the end."
    CODE = "launch"
    LATER_STAGES_READ_IMPORTS = True  # they find the mesh, rank and fully_shard by name

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        framework = training_framework(facts.resolver)
        if framework is not None:
            call, name, how = framework
            self.refuse(
                "FSR403",
                call,
                f"the script trains through {name} (`{code(call.func)}`)",
                f"{name} starts the process group and wraps the model itself; a torchrun process group and "
                "fully_shard on top fail at start-up (the default process group is initialised twice)",
                f"shard with {name}'s own sharding: {how}",
            )
        taken = foreign_binding(facts.resolver)
        if taken is not None:
            node, name, what, module = taken
            self.refuse(
                "FSR405",
                node,
                f"the script binds `{name}` to {what}; the rewrite's lines call {module} as `{name}`",
                f"the rewrite adds `import {module} as {name}`: one of the two bindings replaces the other, and "
                f"either the process group or the script's own `{name}.` calls raise AttributeError at run time",
                f"bind the script's value to another name (e.g. `import torch.distributions as D`), then rewrite again",
            )
        if facts.unfollowed_return is not None:
            helper = facts.unfollowed_return.name.value
            self.refuse(
                "FSR404",
                facts.models[0].stmt,
                f"`{helper}()` builds `{facts.models[0].name}` and returns it in a way the rewrite does not follow: it "
                f"follows `return {facts.models[0].name}` or `return {facts.models[0].name}, optimizer` (plain names, the "
                f"same at every return) into one assignment of plain names, `model, optimizer = {helper}(...)`, "
                f"with `{helper}()` called once",
                "the process group must start before the helper runs and end after its caller is done with the model",
                f"return plain names and call `{helper}()` once, as `model = {helper}(...)` or "
                f"`model, optimizer = {helper}(...)`",
            )
        if facts.entry_block is None:
            return
        if facts.distributed_init is not None:
            self._reuse(facts, editor)
            return
        block = facts.entry_block
        anchor = self._loaded_before_entry(facts) or self._first_torch_statement(block, facts)
        anchor = outside_modules(facts.resolver.module, anchor)  # a linked program: in the entry's own file
        names = {
            key: self.fresh_name(key, facts.entry_scope)
            for key in ("local_rank", "rank", "world_size", "mesh")
        }
        # with CPU offload the optimizer step and clipping run on CPU tensors: they need gloo too
        backend = '"cpu:gloo,cuda:nccl"' if self.options.cpu_offload else '"nccl"'
        mesh = mesh_template(self.options)
        in_helper = facts.entry_call is not None  # the mesh goes where the helper shards the model
        text = (PREAMBLE + ("" if in_helper else mesh)).format(backend=backend, replicas=self.options.hsdp, **names)
        preamble = cst.parse_module(text, config=self.config).body
        if not in_helper:
            facts.mesh_name = names["mesh"]  # for shard, planned on this same analysis (codemods/retrofit.py)
        editor.insert_paragraph_before(anchor, preamble, first_in_block=anchor is facts.resolver.block_of(anchor).body[0])
        if in_helper:
            self._mesh_in_helper(facts, editor, "dist.get_world_size()")
        built_in_method = _method_of_a_class(block, facts)
        if not built_in_method:  # a Solver's __init__ builds the model: the group outlives the method
            self._teardown(block, "dist", facts, editor)
        self.add_import("os")
        self.add_import("torch")
        self.add_import("torch.distributed", asname="dist")
        self.add_import("torch.distributed.device_mesh", "init_device_mesh")
        self.change(
            anchor,
            "read LOCAL_RANK, set the CUDA device, init the process group ("
            + ("cpu:gloo,cuda:nccl for CPU offload" if self.options.cpu_offload else "nccl")
            + ", or gloo without CUDA), "
            + (f"build a 2-D (replicate, shard) device mesh of {self.options.hsdp} replicas for HSDP (the number "
               f"of ranks must be a multiple of {self.options.hsdp}: an assert says so at start-up)"
               if self.options.hsdp else f"build a {mesh_words(self.options)} over all ranks"),
            "torchrun starts one process per GPU; each must pick its own device before any CUDA work",
            "every rank on GPU 0 (hang or OOM) when set_device is missing",
        )
        if not built_in_method:
            self.change(block.body[-1], "destroy the process group at the end", "a clean exit under torchrun")

    def _reuse(self, facts: ScriptFacts, editor: StatementEditor) -> None:
        """The script starts its own process group (torchrun style): keep it, make sure
        the CUDA device is set before it, and build the mesh after it."""
        group = process_group(facts)
        if facts.mesh_name is not None or _shards_already(facts):
            return
        if group.conditional is not None and not self._one_process_otherwise(group, facts, editor):
            self.refuse(
                "FSR401",
                group.init,
                "the process group is started under a condition",
                "fully_shard needs the process group and a device mesh on every run; the script also runs "
                "without one, where the sharded model would have no group",
                "start it directly under one `if` (`if ddp: init_process_group(backend)`, no init_method or rank "
                "arguments; the other branch then gets a process group of one process), or unconditionally",
            )
        block = facts.entry_block
        body = list(block.body)
        # `model, optimizer = build(cfg)`: the helper builds (and shards) the model where it is called
        top = facts.models[0].top if facts.entry_call is None else facts.resolver.statement_of(facts.entry_call)
        if group.start in body and top in body and body.index(top) < body.index(group.start):
            self.refuse(
                "FSR402",
                facts.models[0].stmt,
                f"`{facts.models[0].name}` is built before the script starts its process group",
                "fully_shard needs the device mesh, which needs the process group; sharding must follow the build",
                "start the process group (init_process_group) before building the model",
            )
        self._set_device_first(group, facts, editor)
        self._gloo_without_cuda(group, editor)
        dist = self._dist(group)
        # under `if ddp:` the script's world-size name may be bound in one branch only
        world = (group.conditional is None and group.world_size_name) or f"{dist}.get_world_size()"
        self.add_import("torch")
        self.add_import("torch.distributed.device_mesh", "init_device_mesh")
        if facts.entry_call is not None:  # `model, optimizer = build(cfg)`: the mesh goes into the helper
            self._mesh_in_helper(facts, editor, f"{dist}.get_world_size()")
        else:
            self._mesh_after_group(group, facts, editor, world)
        if not group.destroys:
            self._teardown(block, self._dist(group), facts, editor)
            self.change(block.body[-1], "destroy the process group at the end", "a clean exit under torchrun")

    def _teardown(self, block, dist: str, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`dist.destroy_process_group()` at the end of `block`, before its final `return`. A
        return value that calls anything (`return evaluate(model, loader)`: a forward of the
        sharded model, a collective) is computed first, while the group still exists."""
        teardown = [self.stmt(f"{dist}.destroy_process_group()\n")]
        last = block.body[-1] if block.body else None
        value = last.body[0].value if (
            isinstance(last, cst.SimpleStatementLine) and type(last.body[0]) is cst.Return) else None
        if value is None or not any(type(n) is cst.Call for n in walk(value)):
            editor.append_to(block, teardown)
            return
        name = self.fresh_name("result", facts.entry_scope)
        editor.replace(last, self.stmt(f"{name} = {code(value)}\n").with_changes(leading_lines=last.leading_lines))
        editor.append_to(block, [*teardown, self.stmt(f"return {name}\n")])
        self.change(
            last,
            f"the returned value is computed into `{name}` before the process group is destroyed",
            f"`{code(value)}` runs code that may need the group (a forward of the sharded model, a collective); "
            "after destroy_process_group it would fail or hang",
        )

    def _mesh_after_group(self, group, facts: ScriptFacts, editor: StatementEditor, world: str) -> None:
        block = facts.entry_block
        mesh_name = self.fresh_name("mesh", facts.entry_scope)
        text = mesh_template(self.options).format(mesh=mesh_name, world_size=world, replicas=self.options.hsdp)
        if self.options.mesh_layout == "per_node" and not self.options.hsdp:
            self.add_import("os")
        statements = list(cst.parse_module(text, config=self.config).body)
        facts.mesh_name = mesh_name  # for shard, planned on this same analysis (codemods/retrofit.py)
        if group.start is not None and group.start in block.body:
            anchor = group.start
            if group.world_size_name is not None:
                anchor = self._after_binding(block, anchor, group.world_size_name)
            editor.insert_after(anchor, statements)
        else:
            top = facts.models[0].top
            editor.insert_paragraph_before(top, statements, first_in_block=top is block.body[0])
            anchor = top
        self.change(
            anchor,
            f"reuse the script's process group; build a {mesh_words(self.options)} `{mesh_name}` over its {world} "
            "ranks after it",
            "the script already starts a process group under torchrun: a second init_process_group would fail",
        )

    def _mesh_in_helper(self, facts: ScriptFacts, editor: StatementEditor, world: str) -> str:
        """`model, optimizer = build(cfg)`: the helper shards the model before it builds the
        optimizer, so the mesh is built there, before the model; the process group is its
        caller's. Returns the mesh's name."""
        model = facts.models[0]
        name = self.fresh_name("mesh", model.scope)
        text = mesh_template(self.options).format(mesh=name, world_size=world, replicas=self.options.hsdp)
        if self.options.mesh_layout == "per_node" and not self.options.hsdp:
            self.add_import("os")
        editor.insert_before(model.top, cst.parse_module(text, config=self.config).body)
        facts.mesh_name = name  # for shard, planned on this same analysis (codemods/retrofit.py)
        self.change(
            model.top,
            f"build the device mesh `{name}` here, where `{model.name}` is built, sharded and returned",
            "the helper shards the model before its optimizer is built; the process group is started by its "
            "caller, before the helper runs, and ends there",
        )
        return name

    def _one_process_otherwise(self, group, facts: ScriptFacts, editor: StatementEditor) -> bool:
        """`if ddp: init_process_group(...)` (the optional-DDP switch): the other branch starts
        a process group of its one process, so that fully_shard has a group and a mesh either
        way: under torchrun the group of all ranks, run as plain `python train.py` a group of
        one, which trains like the original single process. False for other shapes."""
        cond = group.conditional
        if not isinstance(cond, cst.If) or group.init_stmt not in cond.body.body or isinstance(cond.orelse, cst.If):
            return False
        if any(k.keyword is not None and k.keyword.value not in ("backend", "timeout") for k in group.init.args):
            return False  # init_method=, store=, rank=, world_size=: the script sets up its own rendezvous
        backend = _backend(group.init)
        bound_in_branch = set().union(*(assigned_names(s) for s in cond.body.body))
        if backend is not None and names_in(backend) & bound_in_branch:
            return False
        if isinstance(backend, cst.SimpleString) and backend.evaluated_value == "nccl":
            backend_text = f'{backend.value} if torch.cuda.is_available() else "gloo"'
        else:
            backend_text = code(backend) if backend is not None else None
        dist = self._dist(group)
        args = ([backend_text] if backend_text else []) + [f"store={dist}.HashStore()", "rank=0", "world_size=1"]
        start = self.stmt(f"{code(group.init.func)}(\n    {', '.join(args)}\n)\n").with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment("# plain `python train.py`: a process group of this one process"))]
        )
        if cond.orelse is not None:
            editor.insert_before(cond.orelse.body.body[0], [start])
        else:
            editor.replace_expression(
                cond, lambda updated: updated.with_changes(orelse=cst.Else(body=cst.IndentedBlock(body=[start])))
            )
        self.add_import("torch")
        self.change(
            group.init,
            "the branch without torchrun starts a process group of its one process (an in-memory store)",
            "fully_shard needs a process group and a mesh on every run: under torchrun they span all ranks, "
            "run as plain python they hold this one process, which trains like the original",
        )
        self._destroy_either_way(cond, group, facts, editor)
        return True

    def _destroy_either_way(self, cond, group, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`if ddp: destroy_process_group()` under the same test as the init: the group now
        exists either way, so the call loses its `if`."""
        body = list(facts.entry_block.body)
        for call in group.destroys:
            stmt = facts.resolver.statement_of(call)
            gate = facts.resolver.parent(facts.resolver.parent(stmt))
            if (
                isinstance(gate, cst.If)
                and gate in body
                and gate.orelse is None
                and list(gate.body.body) == [stmt]
                and code(gate.test) == code(cond.test)
            ):
                editor.replace(gate, stmt.with_changes(leading_lines=gate.leading_lines))
                self.change(gate, "destroy the process group on every run", "the group now exists either way")

    def _gloo_without_cuda(self, group, editor: StatementEditor) -> None:
        """A backend written as the literal "nccl" falls back to gloo without CUDA (CPU runs)."""
        args = group.init.args
        backend = next((a.value for a in args if a.keyword is not None and a.keyword.value == "backend"), None)
        if backend is None and args and args[0].keyword is None:
            backend = args[0].value
        if not (isinstance(backend, cst.SimpleString) and backend.evaluated_value == "nccl"):
            return
        if not isinstance(group.init_stmt, cst.SimpleStatementLine):
            return
        new = self.expr(f'{backend.value} if torch.cuda.is_available() else "gloo"')
        editor.replace(group.init_stmt, group.init_stmt.deep_replace(backend, new))
        self.add_import("torch")
        self.change(
            group.init,
            'the "nccl" backend falls back to "gloo" without CUDA',
            "NCCL needs GPUs; with gloo the same script trains on CPU (tests, laptops)",
        )

    def _dist(self, group) -> str:
        """The script's own spelling of torch.distributed (`dist` in `dist.init_process_group`),
        or `dist`, imported."""
        func = group.init.func
        if isinstance(func, cst.Attribute) and isinstance(func.value, (cst.Name, cst.Attribute)):
            return code(func.value)
        self.add_import("torch.distributed", asname="dist")
        return "dist"

    def _after_binding(self, block, anchor, name: str):
        """`anchor`, or the later statement of the block that binds `name` (the mesh reads it)."""
        body = list(block.body)
        for stmt in body[body.index(anchor) + 1 :]:
            if name in assigned_names(stmt):
                return stmt
        return anchor

    def _set_device_first(self, group, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`torch.cuda.set_device(local_rank)` before init_process_group: moved there when the
        script calls it after, inserted (guarded by is_available) when it never does."""
        r = facts.resolver
        init_order = r.order(group.init)
        if any(r.order(c) < init_order for c in group.set_device):
            return
        block = r.block_of(group.init_stmt)
        body = list(block.body)
        for call in group.set_device:
            holder = r.statement_of(call)
            while holder is not None and holder not in body:
                holder = r.parent(holder)
            if holder is None or body.index(holder) < body.index(group.init_stmt):
                continue
            deps = _environment_reads(body[body.index(group.init_stmt) + 1 : body.index(holder)], holder)
            if deps is None or names_in(holder) & assigned_names(group.init_stmt) or _asks_the_group(holder, r):
                continue  # it reads something computed after the init: leave it
            moved = []
            for stmt in deps + [holder]:
                editor.replace(stmt, None)
                moved.append(stmt)
            if _bare_set_device(holder):  # guarded, so that the script also runs without CUDA
                moved[-1] = self.stmt(f"if torch.cuda.is_available():\n    {code(holder.body[0])}\n")
            editor.insert_before(group.init_stmt, moved)
            self.change(
                holder,
                "`torch.cuda.set_device` moves before init_process_group"
                + (f" (with {', '.join(code(d) for d in deps)})" if deps else "")
                + (", under `if torch.cuda.is_available():`" if _bare_set_device(holder) else ""),
                "NCCL binds each rank's communicator to the current device when the group starts",
                "every rank on GPU 0 (hang or OOM) when set_device comes late",
            )
            return
        local_rank = group.local_rank_name
        new = []
        if local_rank is None:
            local_rank = self.fresh_name("local_rank", r.enclosing_function(group.init))
            new.append(self.stmt(f'{local_rank} = int(os.environ["LOCAL_RANK"])\n'))
            self.add_import("os")
        new.append(self.stmt(f"if torch.cuda.is_available():\n    torch.cuda.set_device({local_rank})\n"))
        self.add_import("torch")
        editor.insert_before(group.init_stmt, new)
        self.change(
            group.init_stmt,
            f"`torch.cuda.set_device({local_rank})` before the script's init_process_group",
            "torchrun starts one process per GPU; each must pick its own device before any CUDA work",
            "every rank on GPU 0 (hang or OOM) when set_device is missing",
        )

    def _loaded_before_entry(self, facts: ScriptFacts):
        """Where the group starts when the model is built under the main guard but a training
        DataLoader is built at module level above it (`loader = DataLoader(...)` then `if __name__
        == "__main__": model = Net()`): the data stage gives that loader a DistributedSampler,
        which asks the group for the rank and world size when it is built, so the group starts
        at module level, before the first statement there that touches torch. Both are module
        scope: the names the preamble binds reach the main guard. None otherwise."""
        module, block = facts.resolver.module, facts.entry_block
        if isinstance(facts.entry_scope, cst.FunctionDef) or block is module or block is None:
            return None
        body = list(module.body)
        guard = next((i for i, stmt in enumerate(body) if _holds(stmt, block, facts)), None)
        sites = [
            _ancestor_in_body(loader.stmt, body, facts)
            for loader in facts.loaders
            if loader.trains and not (loader.sampler is not None and loader.sampler.kind in ("distributed", "per_rank"))
            and facts.resolver.enclosing_function(loader.stmt) is None  # built at module level, not by a helper
        ]
        early = [body.index(s) for s in sites if s is not None and guard is not None and body.index(s) < guard]
        if not early:
            return None
        first = self._first_torch_statement(module, facts)
        return first if first in body and body.index(first) <= min(early) else body[min(early)]

    def _first_torch_statement(self, block, facts: ScriptFacts):
        """The first statement of the entry block that touches torch or builds the model."""
        model_names = {m.name for m in facts.models + facts.copies + facts.frozen_models}
        # `self.model = Net()` in a Solver's __init__: the build itself (names_in sees `self`, not `self.model`)
        builds = {id(node) for m in facts.models + facts.copies + facts.frozen_models for node in (m.stmt, m.top)}
        # `run_dir = ...time.strftime(...)` reaching a path every rank uses: rank 0's value is
        # broadcast right after it (codemods/shared_names.py), so the group starts before it
        named = {id(rec.binding) for rec in rank_local_names(facts) if every_rank_binds(rec, facts)}
        # a `download=True` dataset: rank 0 downloads first, behind a barrier (codemods/shared_downloads.py)
        named |= {id(site.stmt) for site in download_sites(facts)}
        # `loader = get_data(args)`: a helper of a sibling module builds the DataLoader, and the data
        # stage gives it a DistributedSampler there, which asks the group for the rank when it is built
        named |= {id(found.call) for found in sibling_loaders(facts.resolver, facts.classes)}
        # the same with the helper in this file (`def get_loader(bs): ... return DataLoader(...)`)
        named |= {id(call) for call in facts.analysis.loader_helper_calls(facts.loaders, facts.entry_scope)}
        for stmt in block.body:
            if isinstance(stmt, (cst.Import, cst.ImportFrom, cst.FunctionDef, cst.ClassDef)):
                continue
            if isinstance(stmt, cst.SimpleStatementLine) and all(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
            ):
                continue
            if _is_docstring(stmt) or is_main_guard(stmt):
                continue
            if _touches_torch(stmt, facts) or names_in(stmt) & model_names or id(stmt) in builds:
                return stmt
            if named and any(id(node) in named for node in walk(stmt)):
                return stmt
            if facts.entry_call is not None and any(c is facts.entry_call for c in calls_in(stmt)):
                return stmt  # `model, optimizer = build(cfg)`
        return facts.models[0].stmt if facts.entry_call is None else facts.resolver.statement_of(facts.entry_call)


def _ancestor_in_body(stmt, body, facts: ScriptFacts):
    """The statement of the module's `body` that holds `stmt`, or None."""
    node = stmt
    while node is not None and not any(node is b for b in body):
        node = facts.resolver.parent(node)
    return node


def _holds(stmt, block, facts: ScriptFacts) -> bool:
    """`block` is `stmt`'s own or one nested in it."""
    node = block
    while node is not None and node is not stmt:
        node = facts.resolver.parent(node)
    return node is stmt


def _environment_reads(between, holder):
    """The statements of `between` that bind what `holder` reads, if each only reads the
    environment (`local_rank = int(os.environ["LOCAL_RANK"])`); None if one reads more."""
    wanted = names_in(holder)
    deps = []
    for stmt in reversed(between):
        bound = assigned_names(stmt)
        if not bound & wanted:
            continue
        text = code(stmt)
        if not ("environ" in text or "getenv" in text) or "dist." in text or "get_rank" in text:
            return None
        deps.insert(0, stmt)
        wanted |= names_in(stmt)
    return deps


def _asks_the_group(stmt, r) -> bool:
    """`stmt` calls torch.distributed (get_rank, ...): it needs the group started."""
    return any(any(q.startswith("torch.distributed") for q in r.qnames(call)) for call in calls_in(stmt))


def _bare_set_device(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and code(stmt.body[0]).startswith("torch.cuda.set_device(")
    )


def _shards_already(facts: ScriptFacts) -> bool:
    return bool(facts.root_shard)


def _touches_torch(stmt, facts: ScriptFacts) -> bool:
    qnames = facts.resolver.qnames
    return any(
        any(q == "torch" or q.startswith("torch.") for q in qnames(node))
        for node in walk(stmt)
        if type(node) is cst.Name
    )


def _is_docstring(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _backend(init: cst.Call):
    """The backend argument of an init_process_group call (positional or keyword), or None."""
    for arg in init.args:
        if arg.keyword is not None and arg.keyword.value == "backend":
            return arg.value
    if init.args and init.args[0].keyword is None:
        return init.args[0].value
    return None


def _method_of_a_class(block, facts: ScriptFacts) -> bool:
    """`block` is the body of a method (a trainer class's __init__ that builds the model into `self.net`):
    the process group must live on after the method returns, so it is not destroyed there."""
    fn = facts.resolver.enclosing_function(block)
    return fn is not None and facts.resolver.enclosing_class(fn) is not None
