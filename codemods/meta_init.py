"""meta_init: build the model on the meta device; after sharding, allocate and re-initialise it.

Runs before the shard stage: it wraps the build in `with torch.device("meta"):`,
drops the device moves that follow it, and adds `to_empty` and the model's whole
initialisation after the build; the shard stage then puts its fully_shard calls
right after the `with` block, before `to_empty`, so each rank only ever allocates
its own shards. The values are fresh random draws, not the single-process ones.
"""
from __future__ import annotations

from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ModelSite, ScriptFacts, code
from fsdp2_retrofit.analysis.init_replay import CannotReplay, plan_init_replay, split_device_moves
from fsdp2_retrofit.syntax.names import PLACEMENT_METHODS, assigned_names, names_in
from fsdp2_retrofit.syntax.torch_api import TORCH_DEVICE
from fsdp2_retrofit.rewrite.stage import OPTIONS_KEY, RetrofitStage, StatementEditor
from dataclasses import replace

MESH_DEVICE = '"cuda" if torch.cuda.is_available() else "cpu"'
HINT = "drop --meta-init: the default rewrite builds the model as written, then shards it"


class InitOnMetaDeviceCommand(RetrofitStage):
    DESCRIPTION = "--meta-init: build each model on the meta device, then to_empty and re-run its initialisation."
    CODE = "meta_init"
    LATER_STAGES_READ_IMPORTS = True  # the shard stage must see `torch` bound

    def __init__(self, context, options=None) -> None:
        super().__init__(context, options)
        if options is None and OPTIONS_KEY not in context.scratch:
            # run on its own (python -m libcst.tool codemod meta_init.InitOnMetaDeviceCommand):
            # choosing this command is asking for it
            self.options = replace(self.options, meta_init=True)

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not self.options.meta_init:
            return
        for model in facts.models:
            if model.sharded or _built_on_meta(model.top, facts):
                continue
            self._build_on_meta(model, facts, editor)

    def _build_on_meta(self, model: ModelSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        if model.library is not None:
            self.refuse(
                "FSR501",
                model.stmt, f"--meta-init: `{model.name}` is built by {model.library.library}",
                "its initialisation (or its pretrained weights) lives in the library, which the rewrite never "
                "reads: after to_empty nothing could re-create the weights",
                HINT,
            )
        if model.top is not model.stmt:
            self.refuse(
                "FSR502",
                model.stmt, f"--meta-init: `{model.name}` is built inside a compound statement",
                "the meta build, to_empty and re-initialisation need the model built by one plain statement",
                HINT,
            )
        assign = model.stmt.body[0]
        try:
            build, device = split_device_moves(assign.value, facts.resolver)
        except CannotReplay as err:
            self.refuse("FSR503", err.node or model.stmt, f"--meta-init: {err.what}", err.why, HINT)
        ctor = _constructor(build)
        if ctor is None or model.class_name not in facts.resolver.qnames(ctor):
            self.refuse(
                "FSR504",
                model.stmt, f"--meta-init: `{model.name}` is built by `{code(assign.value)}`, not by its class",
                "the re-initialisation is read from the constructor call and the class's __init__",
                "call the model's class in the training script, or " + HINT[0].lower() + HINT[1:],
            )
        later, moved, removed = self._following(model, facts)
        for stmt in removed:
            _, stmt_device = self._placement_device(stmt, model, facts)
            device = stmt_device or device
        try:
            replay = plan_init_replay(
                facts.classes, model.class_name, ctor, facts.resolver, model.name,
                lambda wanted: self.fresh_name(wanted, model.scope),
            )
        except CannotReplay as err:
            self._refuse_replay(err, model)

        editor.replace(model.stmt, self._meta_with(model, assign, build))
        for stmt in removed + moved:
            editor.replace(stmt, None)
        device_code = code(device) if device is not None else MESH_DEVICE
        if self.options.cpu_offload:
            device_code = '"cpu"'  # offloaded shards live in CPU memory; FSDP2 copies each unit to the GPU
        init_lines = list(replay.statements) + [_render(s) for s in moved]
        body = "".join(_indent(text, 4) for text in init_lines)
        new = [
            self.stmt(f"{model.name}.to_empty(device={device_code})\n").with_changes(
                leading_lines=[cst.EmptyLine(comment=cst.Comment(
                    "# --meta-init: memory for this rank's shards only; then re-run the model's initialisation"
                ))]
            ),
            self.stmt(f"with torch.no_grad():\n{body}"),
        ]
        editor.insert_after(later, new)
        self.add_import("torch")
        for module, obj, asname in replay.imports:
            self.add_import(module, obj, asname)
        self.change(
            model.stmt,
            f"build `{model.name}` under `with torch.device(\"meta\")`"
            + (f", without its move to {code(device)}" if device is not None else ""),
            "--meta-init: no memory is allocated until each rank allocates only its shards (to_empty after fully_shard)",
            "a model larger than one device's memory cannot be built whole on every rank",
        )
        self.change(
            model.stmt,
            f"`{model.name}.to_empty(device={device_code})`, then re-run every reset_parameters() and the "
            f"model's own initialisation under torch.no_grad()",
            "to_empty gives the shards memory, not values; the values are fresh random draws "
            "(not the single-process run's), buffers re-computed from the constructor arguments",
        )

    def _following(self, model: ModelSite, facts: ScriptFacts):
        """(the statement to insert after, `model.apply(fn)` statements to re-run after
        to_empty, device moves to drop) among those that place or initialise the model."""
        body = list(model.block.body)
        start = body.index(model.stmt)
        end = body.index(model.shard_anchor) if model.shard_anchor in body else start
        moved: List[cst.CSTNode] = []
        removed: List[cst.CSTNode] = []
        for stmt in body[start + 1 : end + 1]:
            kind, _ = self._placement_device(stmt, model, facts)
            if kind == "device":
                removed.append(stmt)
            elif kind == "init":
                moved.append(stmt)
            elif model.name in names_in(stmt) and not assigned_names(stmt) - {model.name}:
                # e.g. model.load_state_dict(...): on the meta device it reads nothing,
                # and the re-initialisation after to_empty would overwrite it anyway
                self.refuse(
                    "FSR505",
                    stmt, f"--meta-init: `{_first_line(stmt)}` uses `{model.name}` between its build and fully_shard",
                    "with --meta-init the model has no values until to_empty and the re-initialisation after "
                    "sharding, which would also overwrite what this statement does",
                    "load weights after sharding (set_model_state_dict / dcp.load), or " + HINT[0].lower() + HINT[1:],
                )
        return body[end], moved, removed

    def _placement_device(self, stmt, model: ModelSite, facts: ScriptFacts):
        """("device", device expression) for a statement that only moves the model,
        ("init", None) for `model.apply(fn)`, (None, None) for anything else."""
        if isinstance(stmt, cst.If) and stmt.orelse is None and isinstance(stmt.body, cst.IndentedBlock):
            inner = [self._placement_device(s, model, facts)[0] for s in stmt.body.body]
            # `if torch.cuda.is_available(): model.cuda()`: the rank's own device
            return ("device", None) if inner and all(k == "device" for k in inner) else (None, None)
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            return None, None
        small = stmt.body[0]
        value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
        if isinstance(small, cst.Assign) and assigned_names(stmt) != {model.name}:
            return None, None
        if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)):
            return None, None
        if value.func.attr.value == "apply" and isinstance(value.func.value, cst.Name) \
                and value.func.value.value == model.name:
            return "init", None
        if value.func.attr.value not in PLACEMENT_METHODS:
            return None, None
        try:
            rest, device = split_device_moves(value, facts.resolver)
        except CannotReplay as err:
            self.refuse("FSR503", err.node or stmt, f"--meta-init: {err.what}", err.why, HINT)
        if isinstance(rest, cst.Name) and rest.value == model.name:
            return "device", device
        return None, None  # a dtype change: it works on the meta model, keep it

    def _meta_with(self, model: ModelSite, assign: cst.Assign, build) -> cst.With:
        stmt = model.stmt
        inner = stmt.with_changes(body=[assign.with_changes(value=build)], leading_lines=[])
        return cst.With(
            items=[cst.WithItem(item=self.expr('torch.device("meta")'))],
            body=cst.IndentedBlock(body=[inner]),
            leading_lines=stmt.leading_lines,
        )

    def _refuse_replay(self, err: CannotReplay, model: ModelSite) -> None:
        where = ""
        line = model.stmt
        if err.info is not None and err.info.namespace and err.node is not None:
            # a class of a sibling module: name its file and line, point at the build
            position = err.info.namer.resolver.line(err.node)
            where = f" ({err.info.file}:{position})"
        elif err.node is not None and self.line(err.node):
            line = err.node
        self.refuse("FSR503", line, f"--meta-init: {err.what}{where}", err.why, err.hint or HINT)


def _built_on_meta(top, facts: ScriptFacts) -> bool:
    return isinstance(top, cst.With) and any(
        facts.resolver.is_call_to(item.item, TORCH_DEVICE) and item.item.args
        and isinstance(item.item.args[0].value, cst.SimpleString)
        and item.item.args[0].value.evaluated_value == "meta"
        for item in top.items
    )


def _constructor(expr) -> Optional[cst.Call]:
    """`Net(...)` in `Net(...)`, `Net(...).half()`."""
    while isinstance(expr, cst.Call):
        if isinstance(expr.func, cst.Attribute) and isinstance(expr.func.value, cst.Call):
            expr = expr.func.value
            continue
        return expr
    return None


def _first_line(stmt: cst.CSTNode) -> str:
    return code(stmt).splitlines()[0]


def _render(stmt: cst.CSTNode) -> str:
    return cst.Module(body=[stmt.with_changes(leading_lines=[])]).code


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))
