"""migrate_spawn: an `mp.spawn(worker, args=(...), nprocs=N)` launcher becomes a
torchrun program: the worker runs once per process, its rank and world size come
from the environment, and its process group joins over env://."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.spawn import SpawnSite, in_worker, spawns
from fsdp2_retrofit.rewrite.edit import without_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

LOCAL_RANK = 'int(os.environ["LOCAL_RANK"])'
WORLD_SIZE = 'int(os.environ["WORLD_SIZE"])'
DROPPED_SPAWN = {"start_method": "torchrun starts the processes", "daemon": "torchrun starts the processes"}


class MigrateSpawnCommand(RetrofitStage):
    DESCRIPTION = "Turn an mp.spawn launcher into a torchrun program (rank and world size from the environment)."
    CODE = "migrate_spawn"
    LATER_STAGES_READ_IMPORTS = True

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        tree = super().transform_module_impl(tree)
        return self.remove_unused_imports(tree)

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        sites = spawns(facts)
        if not sites:
            return
        if len(sites) > 1:
            self.refuse("FSR101", sites[1].call, "the script calls mp.spawn more than once",
                        "torchrun starts one set of processes", "launch one worker function")
        site = sites[0]
        self._refuse_unsafe(site, facts)
        worker = site.worker
        params = [p.name.value for p in worker.params.params]
        init_kw = {a.keyword.value: a.value for a in site.init.args if a.keyword is not None}
        world_param = code(in_worker(site, init_kw["world_size"])) if "world_size" in init_kw else None
        args = []
        for param, value in zip(params[1:], site.args):
            same_as_nprocs = site.nprocs is not None and code(value) == code(site.nprocs)
            args.append(WORLD_SIZE if param == world_param or same_as_nprocs else code(value))
        call = f"{worker.name.value}({', '.join([LOCAL_RANK] + args)})"
        stmt = site.stmt
        editor.replace(stmt, stmt.with_changes(body=[cst.Expr(self.expr(call))]))
        self.add_import("os")
        self.change(
            stmt,
            f"`{code(site.call.func)}({worker.name.value}, ...)` -> `{call}`",
            "torchrun starts the processes: each runs the script once and calls the worker itself, with "
            f"LOCAL_RANK as the worker's `{params[0]}` (its spawn index on one node) and WORLD_SIZE for the world size",
            "launch with torchrun --nproc_per_node=N (the old nprocs)",
        )
        for key, value in init_kw.items():
            if key in ("init_method", "rank", "world_size"):
                self.change(
                    site.init,
                    f"dropped `{key}={code(value)}` of init_process_group",
                    "torchrun provides the rendezvous (MASTER_ADDR/MASTER_PORT), RANK and WORLD_SIZE: the default "
                    "env:// reads them",
                )
        for key in ("init_method", "rank", "world_size"):
            if key in init_kw:
                editor.replace_expression(site.init, lambda call, key=key: without_keyword(call, key))
        for s in site.rendezvous:
            editor.replace(s, None)
            self.change(s, f"`{code(s)}` goes", "torchrun sets MASTER_ADDR and MASTER_PORT for every process")
        for key in site.other_kwargs:
            self.change(stmt, f"dropped `{key}=` of mp.spawn", DROPPED_SPAWN[key])
        self.attention(
            stmt,
            f"the worker's `{params[0]}` is the local rank (LOCAL_RANK)",
            "on one node it equals the global rank, as with mp.spawn; on several nodes gate rank-0 work on "
            "dist.get_rank() instead",
        )
        for node in facts.resolver.nodes(cst.Import):
            for alias in node.names:
                if code(alias.name) == "torch.multiprocessing":
                    from libcst.codemod.visitors import RemoveImportsVisitor  # here: it loads libcst.matchers

                    asname = code(alias.asname.name) if alias.asname else None
                    RemoveImportsVisitor.remove_unused_import(self.context, "torch.multiprocessing", asname=asname)

    def _refuse_unsafe(self, site: SpawnSite, facts: ScriptFacts) -> None:
        spawn = code(site.call.func)
        if site.worker is None:
            self.refuse("FSR102", site.call, f"the function {spawn} starts is not a top-level function of this script",
                        "the rewrite must call it once per torchrun process and rewrite its process group",
                        "spawn a function defined in this script")
        if site.args is None:
            self.refuse("FSR103", site.call, f"the args of {spawn} are not a tuple written in the call",
                        "each argument must be mapped to the worker's parameters (and the world size to WORLD_SIZE)",
                        "write args=(a, b, ...) in the call")
        if not (isinstance(site.stmt, cst.SimpleStatementLine) and isinstance(site.stmt.body[0], cst.Expr)
                and site.stmt.body[0].value is site.call):
            self.refuse("FSR104", site.call, f"the result of {spawn} is used",
                        "torchrun workers return nothing to a launcher: there is no spawn context or return value",
                        f"call {spawn}(...) as a statement of its own")
        for key in site.other_kwargs:
            if key not in DROPPED_SPAWN:
                self.refuse("FSR105", site.call, f"`{key}=` of {spawn}",
                            "with join=False (or other launcher options) the launching process keeps working "
                            "alongside its workers; under torchrun there is no launching process",
                            "join the workers (the default) and run rewrite again")
        for expr in site.process_objects:
            self.refuse("FSR106", expr, f"`{code(expr)}` is handed to the workers by {spawn}",
                        "queues, pipes, managers and shared values live in the launching process: torchrun "
                        "workers are separate programs and cannot receive them (it cannot be derived from the "
                        "environment)",
                        "exchange results through files or collectives (dist.gather_object) instead")
        worker = site.worker
        params = worker.params
        starred = isinstance(params.star_arg, cst.Param) or params.star_kwarg is not None or params.kwonly_params
        if starred or len(params.params) != 1 + len(site.args):
            self.refuse("FSR107", worker, f"{worker.name.value}() does not take exactly the index plus the {len(site.args)} spawn args",
                        "the rewrite maps each spawn argument to one parameter", "give the worker plain parameters")
        if site.init is None:
            self.refuse("FSR108", worker, f"{worker.name.value}() starts no process group (in its body, or a function of the program it calls)",
                        "an mp.spawn worker without init_process_group cannot become a torchrun worker automatically",
                        "call dist.init_process_group in the worker")
        init_kw = {a.keyword.value: a.value for a in site.init.args if a.keyword is not None}
        first = worker.params.params[0].name.value
        if "store" in init_kw:
            self.refuse("FSR109", site.init, "init_process_group is given a store",
                        "torchrun's env:// rendezvous replaces the store", "drop store= and run rewrite again")
        if "rank" in init_kw and code(in_worker(site, init_kw["rank"])) != first:
            self.refuse("FSR110", site.init, f"the global rank is computed (`rank={code(init_kw['rank'])}`)",
                        "torchrun's RANK replaces it, but the script's own rank arithmetic (node rank x GPUs per "
                        "node) would stay in use elsewhere", "pass the spawn index as the rank")
        if any(a.keyword is None for a in site.init.args[1:]):
            self.refuse("FSR111", site.init, "init_process_group takes positional arguments after the backend",
                        "init_method/world_size/rank must be recognised to be dropped", "pass them by keyword")
