"""The fully_shard statements of one model's units (repeated blocks, leaf layers, the root) and
the report lines that say why: the shard stage's edits, apart from its decisions (shard.py)."""
from __future__ import annotations

from fsdp2_retrofit.analysis import ModelSite, ScriptFacts, code
from fsdp2_retrofit.analysis.leaf_units import model_leaf_layout, model_parameter_count
from fsdp2_retrofit.analysis.penalties import penalty_models


class ShardUnits:
    """Statements that shard one model unit by unit, written in the style of the stage's file."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self.options = stage.options
        self.stmt, self.change, self.attention = stage.stmt, stage.change, stage.attention
        self.fresh_name, self.add_import, self.line = stage.fresh_name, stage.add_import, stage.line

    @property
    def facts(self) -> ScriptFacts:
        return self.stage.facts

    def _class_line(self, node, model: ModelSite) -> int:
        return self.stage._class_line(node, model)

    def statements(self, model: ModelSite, facts: ScriptFacts, policies: str = ""):
        mesh = (f", mesh={facts.mesh_name}" if facts.mesh_name else "") + policies
        out = []
        # a model a gradient penalty differentiates twice keeps every unit gathered (analysis/penalties.py)
        held = any(model is m for m in penalty_models(facts))
        self.policy = "never" if held else self.options.reshard_after_forward
        # a frozen model or a copy runs forward only: every unit, the root too, frees its
        # gathered parameters after forward (no backward would gather them again)
        forward_only = model.copy_of is not None or any(model is f for f in facts.frozen_models)
        self._report_untrained(model, facts)
        if model.late_init is not None:
            self.attention(
                model.late_init,
                f"`{code(model.late_init)}` runs on the sharded `{model.name}`: each rank initialises its own "
                "shards, not the weights the single-process run draws",
                "it is in an if/else with other work (a checkpoint load that must follow fully_shard) that the "
                "rewrite does not split (its test calls something, or the branch does more than initialise), so "
                "it cannot move before fully_shard; the initialisation is as valid, but the run does not start "
                f"from the same weights (move `{code(model.late_init)}` before the `if` for that)",
                differs=True,
            )
        if self.options.shard:
            var = self.fresh_name("module", model.scope)
            keep = ", reshard_after_forward=False" if self.policy == "never" else ""
            classes = ", ".join(f'"{c.rsplit(".", 1)[-1]}"' for c in self.options.shard)
            out.append(
                self.stmt(
                    f"for {var} in reversed(list({model.name}.modules())):\n"
                    f"    if type({var}).__name__ in ({classes},) and {var} is not {model.name}:\n"
                    f"        fully_shard({var}{mesh}{keep})\n"
                )
            )
            self.change(
                model.shard_anchor,
                f"fully_shard every {', '.join(self.options.shard)} inside `{model.name}`, innermost first",
                "--shard names the units: each one's parameters are gathered only while it runs",
            )
        elif model.library is not None and model.library.no_split_modules:
            out.extend(self._no_split_statements(model, mesh))
        elif model.runtime_blocks:
            out.extend(self._runtime_block_statements(model, mesh, forward_only))
        else:
            var = self.fresh_name("block", model.scope)
            policy = self.policy
            if model.library is not None and model.containers:
                self.change(
                    model.stmt, f"`{model.name}` is {model.library.why}",
                    "a library builds it: its layout comes from a table of known library models (never imported)",
                )
            leaves = self._leaf_layout(model, facts, forward_only)
            head_keeps = leaves is not None and any(u.last and not u.runtime for u in leaves.units)
            # a leaf unit decided when the script runs: the counts it compares are taken before fully_shard,
            # and the last block keeps its parameters unless the unit that runs last (the head) is made
            self._head_unit = None
            if leaves is not None:
                out.extend(self._runtime_sizes(model, leaves))
            head_unit = self._head_unit
            for n, container in enumerate(model.containers):
                path = ".".join((model.name,) + container.path)
                unless = f" or {head_unit}" if head_unit else ""
                if container.units_inside:
                    last = policy == "default" and n == len(model.containers) - 1 and not forward_only and not head_keeps
                    out.append(self._inner_units(model, container, path, mesh, last, unless))
                    continue
                if policy == "default" and n == len(model.containers) - 1 and not forward_only and not head_keeps:
                    index = self.fresh_name("index", model.scope)
                    out.append(self.stmt(
                        f"for {index}, {var} in enumerate({path}):\n"
                        f"    fully_shard({var}{mesh}, reshard_after_forward={index} < len({path}) - 1{unless})\n"
                    ))
                    self.change(
                        model.shard_anchor,
                        f"the last block of `{path}` keeps its gathered parameters after forward"
                        + (f" unless `{head_unit}` (then the head's unit runs last and keeps them)" if unless else ""),
                        "backward starts with the last block: resharding it only to gather it again at once "
                        "costs a second all-gather (torchtitan's default; --reshard-after-forward always|never)",
                    )
                else:
                    keep = ", reshard_after_forward=False" if policy == "never" else ""
                    out.append(self.stmt(f"for {var} in {path}:\n    fully_shard({var}{mesh}{keep})\n"))
                self.change(
                    model.shard_anchor,
                    f"fully_shard each {container.block_class} in `{path}`",
                    "a unit per repeated block: only one block's parameters are gathered at a time",
                    "a ModuleList passed to fully_shard itself has no forward: its hooks never fire",
                )
            if leaves is not None:
                out.extend(self._leaf_statements(model, leaves, mesh))
            for container in model.tied_containers:
                path = ".".join((model.name,) + container.path)
                self.attention(
                    self._class_line(container.node, model),
                    f"`{path}` shares a parameter with another module; its blocks stay in the root unit",
                    "tied parameters must live in one FSDP unit",
                )
            if not model.containers and not model.tied_containers:
                self.attention(
                    model.stmt,
                    f"no repeated blocks found in `{model.name}`: only the root is sharded",
                    f"`{model.name}` is {model.library.why}" if model.library is not None
                    else "pass --shard CLASS to make each block of that class its own unit",
                )
        keep = ", reshard_after_forward=False" if self.policy == "never" else ""
        if forward_only and not keep:
            keep = ", reshard_after_forward=True"  # the root would otherwise keep its gathered parameters
        out.append(self.stmt(f"fully_shard({model.name}{mesh}{keep})\n"))
        self.change(
            model.shard_anchor,
            f"fully_shard the root `{model.name}` after its blocks",
            "the root unit holds what no block holds (embeddings, head); bottom-up order",
            "sharding the root first takes every parameter into one unit",
        )
        if held:
            out.append(self._hold_for_penalty(model, facts))
        return out

    def _hold_for_penalty(self, model: ModelSite, facts: ScriptFacts):
        """`model.set_reshard_after_backward(False)`, and the report of what holding the units costs."""
        count = model_parameter_count(facts, model)
        size = (f"{count:,} parameters, {_megabytes(count * 4)} in float32, on every rank" if count is not None
                else "its full parameter size on every rank")
        self.change(
            model.shard_anchor,
            f"every unit of `{model.name}` keeps its gathered parameters from forward through backward "
            f"(reshard_after_forward=False, `{model.name}.set_reshard_after_backward(False)`); they are resharded "
            "before its optimizer steps",
            "its gradient penalty (autograd.grad with create_graph) takes a second backward that reads the gathered "
            f"parameters, which FSDP2 would free after the first. The cost: `{model.name}` whole ({size}) from its "
            "first forward to its optimizer step; its gradients and optimizer state stay sharded",
            "with the default resharding the second backward fails ('The tensor has a non-zero number of elements, "
            "but its data is not allocated yet')",
        )
        return self.stmt(f"{model.name}.set_reshard_after_backward(False)  # the gradient penalty reads them\n")

    def _inner_units(self, model: ModelSite, container, path: str, mesh: str, last: bool, unless: str = ""):
        """Blocks that are containers whose forward never runs (an inner ModuleList or
        ModuleDict, or a Sequential the model takes apart): a unit per child of each block,
        the modules the forward calls."""
        layer = self.fresh_name("layer", model.scope)
        var = self.fresh_name("block", model.scope)
        children = f"{layer}.values()" if container.inner == "ModuleDict" else layer
        keep = ""
        if self.policy == "never":
            keep = ", reshard_after_forward=False"
        elif last and container.inner != "ModuleDict":
            keep = f", reshard_after_forward={var} is not {path}[-1][-1]{unless}"
        classes = ", ".join(dict.fromkeys(c.rsplit(".", 1)[-1] for c in container.inner_classes))
        self.change(
            model.shard_anchor,
            f"fully_shard each module inside each inner {container.inner} of `{path}` ({classes})",
            "the modules the forward calls are the units: an inner "
            + (f"{container.inner} has no forward of its own"
               if container.inner != "Sequential" else "Sequential that forward takes apart never runs its forward")
            + ", so FSDP2's pre-forward hook on it would never gather its parameters"
            + (f"; the last module of `{path}[-1]` keeps its gathered parameters after forward (backward starts "
               "there)" if "is not" in keep else ""),
            "fully_shard(inner ModuleList) raises (a container without forward) or, on older torch, leaves its "
            "parameters sharded when its children run",
        )
        return self.stmt(
            f"for {layer} in {path}:\n"
            f"    for {var} in {children}:\n"
            f"        fully_shard({var}{mesh}{keep})\n"
        )

    def _leaf_layout(self, model: ModelSite, facts: ScriptFacts, forward_only: bool):
        """Large leaves of a trained model outside its blocks (analysis/leaf_units.py), for the
        default unit choice only (--shard names the units itself)."""
        if forward_only or self.options.shard:
            return None
        version = self.options.torch_version
        lists = not version or tuple(int(p) for p in version.split(".")[:2]) >= (2, 5)
        return model_leaf_layout(facts, model, lists)

    def _runtime_sizes(self, model: ModelSite, layout) -> list:
        """Where a leaf unit is decided when the script runs (a size the rewrite cannot read): one
        block's parameter count, taken before anything is sharded, and, for the unit that runs last
        under the default policy, whether it is made (the last block's resharding depends on it)."""
        self._head_unit, self._block_size = None, None
        if not any(u.runtime for u in layout.units):
            return []
        self._block_size = self.fresh_name("block_size", model.scope)
        counts = [self._count(model, (model.name,) + c, "[0]") for c in layout.containers]
        count = counts[0] if len(counts) == 1 else f"max({', '.join(counts)})"
        out = [self.stmt(
            f"{self._block_size} = {count}"
            "  # one block's: a leaf that holds as many becomes a unit\n"
        )]
        last = next((u for u in layout.units if u.runtime and u.last), None)
        if last is not None and self.policy == "default":
            self._head_unit = self.fresh_name(f"{last.paths[-1][-1]}_unit", model.scope)
            out.append(self.stmt(
                f"{self._head_unit} = {self._count(model, (model.name,) + last.paths[-1])} >= {self._block_size}\n"
            ))
        return out

    def _count(self, model: ModelSite, path, index: str = "") -> str:
        p = self.fresh_name("p", model.scope)
        return f"sum({p}.numel() for {p} in {'.'.join(path)}{index}.parameters())"

    def _leaf_statements(self, model: ModelSite, layout, mesh: str) -> list:
        """fully_shard each leaf unit (an embedding, `[final norm, head]`), after the blocks,
        before the root; the unit that runs last in forward keeps its parameters gathered. A unit
        of a size known at run time is made under an `if` that compares its count with a block's."""
        out = []
        policy = self.policy
        sources = ", ".join(f"{option} ({value!r})" for option, value in layout.sources.items())
        for unit in layout.units:
            names = [".".join((model.name,) + p) for p in unit.paths]
            target = names[0] if len(names) == 1 else f"[{', '.join(names)}]"
            keep = ""
            if policy == "never" or policy == "default" and unit.last:
                keep = ", reshard_after_forward=False"
            shard = f"fully_shard({target}{mesh}{keep})\n"
            if unit.runtime:
                test = (self._head_unit if unit.last and self._head_unit else
                        f"{self._count(model, (model.name,) + unit.paths[-1])} >= {self._block_size}")
                out.append(self.stmt(f"if {test}:\n    {shard}"))
            else:
                out.append(self.stmt(shard))
            one = "" if unit.runtime else f"; one block: {layout.block_params:,}"
            self.change(
                model.shard_anchor,
                f"fully_shard {' and '.join(f'`{n}`' for n in names)} as a unit of {'their' if len(names) > 1 else 'its'} own"
                + (f" where `{names[-1]}` holds at least one block's parameters" if unit.runtime else "")
                + f" ({unit.what}{one})"
                + (f"; sized from the default{'s' if len(layout.sources) > 1 else ''} of {sources}"
                   if sources and not unit.runtime else ""),
                "left in the root it would stay gathered through forward and backward; as a unit it is gathered "
                "only while it runs (torchtitan's layout: embeddings, blocks, final norm with the head, root)"
                + (": it runs last in forward, so it keeps its parameters for backward, and the last block "
                   "reshards" if keep and policy == "default" else "")
                + ("; its size is not in the source (read from data or computed), so the generated code compares the "
                   "parameter counts when it runs" if unit.runtime else "")
                + ("; the command line may give other sizes (the layout changes memory and communication, never "
                   "the numbers)" if sources and not unit.runtime else ""),
                "the root unit holds it whole on every rank for the whole step",
            )
        for path, why, runtime in layout.kept:
            held = ("may hold more parameters than one block (its size is known at run time)" if runtime else
                    f"holds at least one block's parameters ({layout.block_params:,})")
            self.attention(
                model.stmt,
                f"`{'.'.join((model.name,) + path)}` stays in the root unit although it {held}: {why}",
                "a unit of its own would be gathered only while it runs; here that is not safe or not known",
            )
        return out

    def _no_split_statements(self, model: ModelSite, mesh: str) -> list:
        """A transformers model whose class is decided at run time: a unit per module of
        a class in `model._no_split_modules`, innermost first, found when it runs."""
        blocks = self.fresh_name("blocks", model.scope)
        var = self.fresh_name("block", model.scope)
        m = self.fresh_name("module", model.scope)
        policy = self.policy
        keep = {"default": f", reshard_after_forward={var} is not {blocks}[-1]", "never": ", reshard_after_forward=False"}
        self.change(
            model.stmt,
            f"`{model.name}` is {model.library.why}",
            "transformers lists in `_no_split_modules` the layer classes it never splits (its own device map "
            "and FSDP wrapping use them); without such classes only the root is sharded",
        )
        classes = self.fresh_name("no_split", model.scope)
        return [self.stmt(
            f"{classes} = {model.name}._no_split_modules or ()\n"
        ), self.stmt(
            f"{blocks} = [{m} for {m} in {model.name}.modules() if type({m}).__name__ in {classes}]\n"
        ), self.stmt(
            f"for {var} in reversed({blocks}):\n"
            f"    fully_shard({var}{mesh}{keep.get(policy, '')})\n"
        )]


    def _runtime_block_statements(self, model: ModelSite, mesh: str, forward_only: bool) -> list:
        """A model whose class the script chooses at run time: a unit per child of each
        ModuleList/Sequential whose children share one class, found when it runs,
        innermost first (a child that shares a parameter with another module stays in
        the root, as tied blocks do); none found: the root alone."""
        r = self.facts.resolver
        nn = r.local_name("torch.nn") or "torch.nn"
        self.add_import("torch")
        self.add_import("collections")
        uses = self.fresh_name("uses", model.scope)
        blocks = self.fresh_name("blocks", model.scope)
        container = self.fresh_name("container", model.scope)
        child = self.fresh_name("child", model.scope)
        p = self.fresh_name("p", model.scope)
        var = self.fresh_name("block", model.scope)
        policy = self.policy
        keep = {"default": f", reshard_after_forward={var} is not {blocks}[-1]", "never": ", reshard_after_forward=False"}
        if forward_only and policy != "never":
            keep = {}
        chosen = ", ".join(c.rsplit(".", 1)[-1] for c in model.alternatives)
        self.change(
            model.stmt,
            f"`{model.name}` is one of {chosen}, chosen at run time: its repeated blocks are found when it runs "
            f"(each child of a ModuleList/Sequential of one class becomes a unit; none: only the root)",
            "the classes' repeated blocks differ (or a table decides), so no one attribute path fits every choice",
        )
        return [self.stmt(
            f"{blocks} = []  # `{model.name}`'s class is chosen at run time: find its repeated blocks\n"
        ), self.stmt(
            f"for {container} in {model.name}.modules():\n"
            f"    if isinstance({container}, ({nn}.ModuleList, {nn}.Sequential)) and len(set(map(type, {container}))) == 1:\n"
            f"        {blocks} += [{child} for {child} in {container} if not isinstance({child}, ({nn}.ModuleList, {nn}.ModuleDict))]\n"
        ), self.stmt(
            f"{uses} = collections.Counter(id({p}) for _, {p} in {model.name}.named_parameters(remove_duplicate=False))\n"
        ), self.stmt(
            f"{blocks} = [{var} for {var} in {blocks} if all({uses}[id({p})] == 1 for {p} in {var}.parameters())]"
            "  # tied: in the root unit\n"
        ), self.stmt(
            f"for {var} in reversed({blocks}):  # innermost first\n"
            f"    fully_shard({var}{mesh}{keep.get(policy, '')})\n"
        )]

    def _report_untrained(self, model: ModelSite, facts: ScriptFacts) -> None:
        if model.copy_of is not None:
            self.change(
                model.stmt,
                f"shard the copy `{model.name}` exactly like `{model.copy_of}` (same units, same mesh), after "
                f"`{model.copy_of}`",
                "an EMA update over zip(ema.parameters(), model.parameters()) then pairs identically sharded "
                "DTensors: each rank averages its own shards; saves of its state go through get_model_state_dict",
                "FSDP2 modules cannot be deep-copied: the copy is made before the model is sharded",
            )
            source = facts.model(model.copy_of)
            if source is not None:
                self.change(
                    source.stmt,
                    f"`{source.name}` is sharded after `{code(model.stmt).strip()}`",
                    "the copy must be taken of the plain module, before fully_shard",
                )
        elif any(model is f for f in facts.frozen_models):
            self.change(
                model.stmt,
                f"shard the frozen `{model.name}` too (no optimizer trains it): every unit frees its gathered "
                "parameters after forward",
                "each rank keeps 1/N of it and gathers one unit at a time in its forward (no gradients, no "
                "reduce-scatter); the outputs are those of the full model. --frozen-models replicate keeps a "
                "full copy per rank instead (no communication, full memory)",
                "its forward is now a collective: every rank must run it, never under a rank-0 `if`",
            )



def _megabytes(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"
