"""Recall of `fsdp2-retrofit check`: how many defects that break FSDP2 training at run time it flags.

    python benchmarks/check_recall.py [--realworld DIR] [--out FILE] [--no-corpus] [--codebases MIRRORS]

Two sets of broken outputs, and one of correct ones:

* correct outputs: the golden `expected.py` of every rewrite fixture (each one passes its
  2-rank execution test), and every file of fixtures/check/projects (correct FSDP2 code,
  read, not run). `check` must report nothing on them: any finding is a false positive.
* planted defects: MUTATIONS below, each one small textual edit of one golden (an exact
  `old` text that must occur exactly once, replaced by `new`) that plants one defect seen
  in real FSDP2 code. A golden is a fixture's expected.py, or (a `fixture` starting with
  `projects/`) a file of the multi-file projects under fixtures/check/projects, whose
  sharding helper lives in another module of the project (torchtitan, torchtune and lingua
  shard that way): the mutated file is checked at its own path, beside its modules. Each names the defect in words and the rule expected to catch it
  (None where no rule does: it counts as a miss). Caught: the expected rule is among the
  findings of the mutated file.
* corpus failures: every row of the real-world corpus (benchmarks/realworld, its
  results/results.json and the rewritten outputs in its git-ignored work/ID/rewritten/)
  whose verdict is `crash` (the original itself running: rows whose detail starts with
  RECIPE are left out) or `silently-wrong`. CORPUS_CAUSES names, per row, the cause read
  from its detail and output, and the rule that flags it (None: no rule; a miss). A row
  not in that table is reported as "cause not named" and counted as a miss.

With --codebases, a fourth part: precision and recall on real FSDP2 codebases at pinned commits
(benchmarks/check_codebases.py: every finding classified true or false by a written rule, and
defects planted in their files where the model is sharded in another module).

Nothing here imports torch or runs the scripts: `check` is a static lint. The result is a
markdown table written to --out (default benchmarks/results/check_recall.md).
tests/test_check_recall.py runs the planted table (each edit applies once, goldens clean).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FIXTURES = REPO / "fixtures" / "rewrite"
PROJECTS = REPO / "fixtures" / "check" / "projects"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "check_recall.md"


@dataclass(frozen=True)
class Mutation:
    id: str
    defect: str  # the defect class, in words
    fixture: str  # fixtures/rewrite/<fixture>/expected.py
    old: str  # exact text; must occur exactly once in the golden
    new: str
    expect: Optional[str]  # the rule code expected to flag it; None: no rule does
    blind: bool = False  # written after the rules, and no rule was changed for it: an out-of-sample row


@dataclass(frozen=True)
class CorpusCause:
    cause: str
    expect: Optional[str]


# Recurring snippets of the goldens (the rewriter writes them the same way everywhere).
_SET_DEVICE = "    if torch.cuda.is_available():\n        torch.cuda.set_device(local_rank)\n"
_LOSS_AVG = (
    "            loss_avg = loss.detach().clone()\n"
    "            dist.all_reduce(loss_avg)  # a sum: gloo has no ReduceOp.AVG\n"
)


def _gate(text: str, gate: str = "if rank == 0:", indent: str = "    ") -> str:
    """`text` (whole lines) moved under a rank-0 `if` at its own indentation."""
    first = text.splitlines()[0]
    pad = first[: len(first) - len(first.lstrip())]
    return pad + gate + "\n" + "".join(indent + line + "\n" for line in text.splitlines())


MUTATIONS: Tuple[Mutation, ...] = (
    # --- rank_gated_save: blocks + root sharded, SGD, eval helper, rank-0 prints/saves
    Mutation("forward-call", "`model.forward(x)` on a sharded model (skips FSDP2's pre-forward all-gather)",
             "rank_gated_save", "loss = F.cross_entropy(model(x), y)", "loss = F.cross_entropy(model.forward(x), y)",
             "FSD101"),
    Mutation("torch-save-state", "`torch.save` of a sharded model's state dict (each rank writes its shards)",
             "rank_gated_save", "    dcp.save(get_model_state_dict(model), checkpoint_id=args.out)\n",
             "    torch.save(model.state_dict(), args.out)\n", "FSD102"),
    Mutation("dcp-save-gated", "`dcp.save` (a collective) inside `if rank == 0:` (hangs)",
             "rank_gated_save", "    dcp.save(get_model_state_dict(model), checkpoint_id=args.out)\n",
             _gate("    dcp.save(get_model_state_dict(model), checkpoint_id=args.out)", "if args.local_rank == 0:"),
             "FSD110"),
    Mutation("optimizer-before-shard", "optimizer built from the parameters before `fully_shard` (holds stale tensors)",
             "rank_gated_save",
             "    model = Model()\n    for index, block in enumerate(model.layers):",
             "    model = Model()\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)\n"
             "    for index, block in enumerate(model.layers):", "FSD103"),
    Mutation("shard-order", "root sharded before its blocks", "rank_gated_save",
             "    for index, block in enumerate(model.layers):\n"
             "        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(model.layers) - 1)\n"
             "    fully_shard(model, mesh=mesh)\n",
             "    fully_shard(model, mesh=mesh)\n    for index, block in enumerate(model.layers):\n"
             "        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(model.layers) - 1)\n",
             "FSD104"),
    Mutation("eval-forward-gated-helper", "evaluation forward (through a helper) only on rank 0 (hangs in the all-gather)",
             "rank_gated_save",
             "            val_loss = evaluate(model, val_x, val_y)\n            if master_process:\n",
             "            if master_process:\n                val_loss = evaluate(model, val_x, val_y)\n",
             "FSD110"),
    Mutation("missing-sampler", "training DataLoader without DistributedSampler (every rank reads every batch)",
             "rank_gated_save", "loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)",
             "loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)", "FSD108"),
    Mutation("model-zero-grad", "`model.zero_grad()` between the forward and backward of a sharded model",
             "rank_gated_save", "        optimizer.zero_grad()\n        loss.backward()",
             "        model.zero_grad()\n        loss.backward()", "FSD113"),
    Mutation("missing-set-device", "no `torch.cuda.set_device(LOCAL_RANK)` before init_process_group",
             "rank_gated_save", _SET_DEVICE, "", "FSD106"),
    Mutation("new-submodule-after-shard", "new submodule assigned after `fully_shard` (its parameters never sync)",
             "rank_gated_save", "    fully_shard(model, mesh=mesh)\n",
             "    fully_shard(model, mesh=mesh)\n    model.out = nn.Linear(24, 5)\n", "FSD114"),
    Mutation("shard-modulelist", "`fully_shard` of an nn.ModuleList (not a module with a forward)",
             "rank_gated_save",
             "    for index, block in enumerate(model.layers):\n"
             "        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(model.layers) - 1)\n",
             "    fully_shard(model.layers, mesh=mesh)\n", "FSD109"),
    Mutation("batchnorm", "BatchNorm in a sharded, trained model (batch statistics per rank)",
             "rank_gated_save", "        self.out = nn.Linear(dim, 5)\n",
             "        self.out = nn.Sequential(nn.BatchNorm1d(dim), nn.Linear(dim, 5))\n", "FSD118"),
    Mutation("destroy-gated", "`destroy_process_group()` only on rank 0", "rank_gated_save",
             "    dist.destroy_process_group()\n", _gate("    dist.destroy_process_group()"), "FSD110"),
    # --- accumulation_modulo: set_requires_gradient_sync, clip + full_tensor, AdamW
    Mutation("full-tensor-gated", "`.full_tensor()` (a collective) only on rank 0", "accumulation_modulo",
             "            norm = norm.full_tensor()\n", _gate("            norm = norm.full_tensor()"), "FSD110"),
    Mutation("local-grad-norm", "the clip_grad_norm_ total (a DTensor) read as a number without `.full_tensor()`",
             "accumulation_modulo", "            norm = norm.full_tensor()\n", "", "FSD107"),
    Mutation("all-reduce-gated", "`dist.all_reduce` of the loss only on rank 0", "accumulation_modulo",
             _LOSS_AVG, _gate(_LOSS_AVG.rstrip("\n")), "FSD110"),
    Mutation("clip-gated", "`clip_grad_norm_` of sharded parameters (all-reduces the norm) only on rank 0",
             "accumulation_modulo",
             "            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)\n"
             "            norm = norm.full_tensor()\n",
             _gate("            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)\n"
                   "            norm = norm.full_tensor()"), "FSD110"),
    Mutation("lbfgs", "LBFGS over sharded parameters (flattens DTensor gradients)", "accumulation_modulo",
             "torch.optim.AdamW(model.parameters(), lr=1e-2)", "torch.optim.LBFGS(model.parameters(), lr=1e-2)",
             "FSD115"),
    Mutation("ddp-no-sync", "DDP's `model.no_sync()` on an FSDP2 module (AttributeError)", "accumulation_modulo",
             "        model.set_requires_gradient_sync((i + 1) % args.accum == 0)\n"
             "        model.set_reshard_after_backward((i + 1) % args.accum == 0)\n        loss.backward()\n",
             "        with model.no_sync():\n            loss.backward()\n", "FSD105"),
    Mutation("gradient-sync-off", "`set_requires_gradient_sync(False)` never turned back on (gradients never reduced)",
             "accumulation_modulo", "model.set_requires_gradient_sync((i + 1) % args.accum == 0)",
             "model.set_requires_gradient_sync(False)", "FSD123"),
    Mutation("sum-loss", "sum-reduced loss (FSDP2 averages gradients over ranks: the step is world_size x smaller "
             "than the single run's on the same global batch)", "accumulation_modulo",
             "loss = F.cross_entropy(model(x), y) / args.accum",
             "loss = F.cross_entropy(model(x), y, reduction=\"sum\") / args.accum", "FSD119"),
    # --- keep_global_batch_skip_step: per-rank batch = batch_size // world_size
    Mutation("global-batch-shape", "a tensor shaped by the global batch size in a loop over the per-rank loader "
             "(shape error)", "keep_global_batch_skip_step",
             "            x, y = x.to(device), y.to(device)\n",
             "            x, y = x.view(args.batch_size, -1).to(device), y.to(device)\n", "FSD120"),
    Mutation("set-device-constant", "`set_device(0)` on every rank (all ranks on GPU 0)", "keep_global_batch_skip_step",
             "        torch.cuda.set_device(local_rank)\n", "        torch.cuda.set_device(0)\n", "FSD106"),
    Mutation("to-dtype-after-shard", "dtype cast `.to(torch.bfloat16)` of the module after `fully_shard`",
             "keep_global_batch_skip_step", "    fully_shard(model, mesh=mesh)\n",
             "    fully_shard(model, mesh=mesh)\n    model.to(torch.bfloat16)\n", "FSD114"),
    # --- rank_zero_run_dir: a run dir made on rank 0, broadcast to every rank
    Mutation("rank-zero-name", "a name bound only on rank 0 (the run dir) read by `dcp.save` on every rank",
             "rank_zero_run_dir",
             "    run_dir_shared = [run_dir] if master_process else [None]\n"
             "    dist.broadcast_object_list(run_dir_shared, src=0)  # every rank: the save reads it\n"
             "    run_dir = run_dir_shared[0]\n", "", "FSD116"),
    Mutation("broadcast-gated", "`broadcast_object_list` only on rank 0 (the others never receive)",
             "rank_zero_run_dir",
             "    dist.broadcast_object_list(run_dir_shared, src=0)  # every rank: the save reads it\n",
             _gate("    dist.broadcast_object_list(run_dir_shared, src=0)", "if master_process:"), "FSD110"),
    Mutation("no-set-epoch", "DistributedSampler(shuffle=True) without `set_epoch` (the same order every epoch)",
             "rank_zero_run_dir", "        sampler.set_epoch(epoch)\n", "", "FSD121"),
    Mutation("dcp-save-epoch-gated", "per-epoch `dcp.save` under `if master_process:`", "rank_zero_run_dir",
             "        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(run_dir, f\"epoch{epoch}.pt\"))\n",
             _gate("        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(run_dir, f\"epoch{epoch}.pt\"))",
                   "if master_process:"), "FSD110"),
    # --- early_stop_reload: best checkpoint reload through DCP
    Mutation("load-torch-load", "`model.load_state_dict(torch.load(...))` into the sharded model", "early_stop_reload",
             "    set_model_state_dict(model, state_dict)\n",
             "    model.load_state_dict(torch.load(best_path))\n", "FSD112"),
    Mutation("load-plain-dict", "`load_state_dict` of a plain dict after `fully_shard`", "early_stop_reload",
             "    set_model_state_dict(model, state_dict)\n",
             "    model.load_state_dict({k: v.clone() for k, v in state_dict.items()})\n", "FSD114"),
    Mutation("dcp-load-gated", "`dcp.load` only on rank 0", "early_stop_reload",
             "    dcp.load(state_dict, checkpoint_id=best_path)\n",
             _gate("    dcp.load(state_dict, checkpoint_id=best_path)"), "FSD110"),
    Mutation("validate-gated-helper", "validation forward (through a helper) only on rank 0", "early_stop_reload",
             "        val_loss = validate(model, val_loader, device)\n",
             "        val_loss = float(\"inf\")\n" + _gate("        val_loss = validate(model, val_loader, device)"),
             "FSD110"),
    # --- init_hidden_method, train_step_helper, gan_two_models
    Mutation("method-not-registered", "a method other than forward (`init_hidden`) called on the sharded model without "
             "`register_fsdp_forward_method`", "init_hidden_method",
             "    register_fsdp_forward_method(model, \"init_hidden\")\n", "", "FSD122"),
    Mutation("zero-grad-in-helper", "`model.zero_grad()` between forward and backward inside a train-step helper",
             "train_step_helper",
             "    optimizer.zero_grad(set_to_none=True)\n    loss = nn.functional.cross_entropy(model(x), y)\n",
             "    loss = nn.functional.cross_entropy(model(x), y)\n    model.zero_grad(set_to_none=True)\n", "FSD113"),
    Mutation("optimizer-before-shard-gan", "the generator's optimizer built before `fully_shard(G)`", "gan_two_models",
             "    fully_shard(G, mesh=mesh)\n",
             "    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))\n    fully_shard(G, mesh=mesh)\n",
             "FSD103"),
    # --- added after the first rules were written, so the table is not only what they catch
    Mutation("sampler-and-shuffle", "DataLoader given both `sampler=` and `shuffle=True` (ValueError at construction)",
             "rank_zero_run_dir", "loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)",
             "loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=True)", "FSD124"),
    Mutation("sampler-one-replica", "DistributedSampler with constant `num_replicas=1, rank=0` (every rank reads all "
             "the data)", "init_hidden_method", "sampler = DistributedSampler(data, shuffle=True)",
             "sampler = DistributedSampler(data, shuffle=True, num_replicas=1, rank=0)", "FSD124"),
    Mutation("step-gated", "`optimizer.step()` only on rank 0 (the other ranks' shards never update)",
             "rank_zero_run_dir", "            optimizer.step()\n", _gate("            optimizer.step()", "if master_process:"),
             "FSD110"),
    Mutation("backward-gated", "`loss.backward()` only on rank 0 (hangs in the gradient reduce-scatter)",
             "early_stop_reload", "            loss.backward()\n", _gate("            loss.backward()"), "FSD110"),
    Mutation("torch-save-optimizer", "`torch.save` of the optimizer's state dict (DTensor state per rank)",
             "early_stop_reload",
             "            dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(args.out_dir, \"best.pt\"))\n",
             "            torch.save(optimizer.state_dict(), os.path.join(args.out_dir, \"best_optim.pt\"))\n", "FSD102"),
    Mutation("gan-missing-sampler", "the GAN's training DataLoader without a sampler", "gan_two_models",
             "loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)",
             "loader = DataLoader(dataset, batch_size=args.batch_size)", "FSD108"),
    # --- blind rows: written once the rules were done, measured once, no rule changed after
    Mutation("batchnorm-generator", "BatchNorm1d added to the generator of a GAN (two sharded models)",
             "gan_two_models", "            nn.Linear(latent, hidden),\n",
             "            nn.Linear(latent, hidden),\n            nn.BatchNorm1d(hidden),\n", "FSD118", blind=True),
    Mutation("backward-gated-gan", "the discriminator's backward only on rank 0", "gan_two_models",
             "        d_loss.backward()\n", _gate("        d_loss.backward()"), "FSD110", blind=True),
    Mutation("no-set-epoch-kwargs", "set_epoch removed, the loader built from a kwargs dict", "kwargs_shuffle",
             "        sampler.set_epoch(epoch)\n", "", "FSD121", blind=True),
    Mutation("sum-criterion", "a criterion module built with reduction='sum'", "kwargs_shuffle",
             "    loss_fn = nn.CrossEntropyLoss()\n", "    loss_fn = nn.CrossEntropyLoss(reduction=\"sum\")\n", "FSD119",
             blind=True),
    Mutation("zero-grad-epoch-function", "`model.zero_grad()` between forward and backward in a train_one_epoch "
             "function", "loop_function", "        optimizer.zero_grad()\n        loss.backward()\n",
             "        model.zero_grad()\n        loss.backward()\n", "FSD113", blind=True),
    Mutation("forward-call-epoch-function", "`model.forward(x)` inside a train_one_epoch function", "loop_function",
             "        loss = F.cross_entropy(model(x), y)\n", "        loss = F.cross_entropy(model.forward(x), y)\n",
             "FSD101", blind=True),
    Mutation("half-after-shard", "`model.half()` after fully_shard with a MixedPrecisionPolicy",
             "mixed_precision_autocast", "    fully_shard(model, mesh=mesh, mp_policy=mp_policy)\n",
             "    fully_shard(model, mesh=mesh, mp_policy=mp_policy)\n    model.half()\n", "FSD114", blind=True),
    Mutation("hidden-global-batch", "the RNN's hidden state sized by `args.batch_size` (a rank's last batch is "
             "smaller)", "init_hidden_method", "hidden = model.init_hidden(tokens.size(0))",
             "hidden = model.init_hidden(args.batch_size)", "FSD120", blind=True),
    Mutation("param-list-before-shard", "the parameter list taken before fully_shard, the optimizer built from it "
             "after (it holds the unsharded tensors)", "rank_zero_run_dir",
             "    model = Net().to(device)\n    for index, block in enumerate(model.blocks):\n"
             "        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(model.blocks) - 1)\n"
             "    fully_shard(model, mesh=mesh)\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n",
             "    model = Net().to(device)\n    params = list(model.parameters())\n"
             "    for index, block in enumerate(model.blocks):\n"
             "        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(model.blocks) - 1)\n"
             "    fully_shard(model, mesh=mesh)\n    optimizer = torch.optim.SGD(params, lr=0.1)\n", "FSD103", blind=True),
    Mutation("save-compound-gate", "the best checkpoint's dcp.save under `if val_loss < best_val and rank == 0:`",
             "early_stop_reload", "        if val_loss < best_val:\n", "        if val_loss < best_val and rank == 0:\n",
             "FSD110", blind=True),
    Mutation("torch-save-getter", "`torch.save(get_model_state_dict(model), ...)` (sharded state through the "
             "getter)", "accumulation_modulo", "    dcp.save(get_model_state_dict(model), checkpoint_id=args.out)\n",
             "    torch.save(get_model_state_dict(model), args.out)\n", "FSD102", blind=True),
)


# --- cross-module: the sharding helper in another module of the project (fixtures/check/projects)
_TITAN, _TUNE, _LINGUA = "projects/titan/train.py", "projects/tune/recipes/full_finetune.py", "projects/lingua/train.py"
_MOE = "projects/moe/train.py"
_NESTED, _STRATEGY = "projects/nested_pkg/apps/lm/train.py", "projects/strategy/trainer.py"
_METHOD, _METHOD_EVAL = "projects/method_shard/train/module.py", "projects/method_shard/train/evaluate.py"
_METHOD_PROBE = "projects/method_shard/train/probe.py"
_REGISTRY, _REGISTRY_ALT = "projects/registry/train.py", "projects/registry_alt/run.py"
_TITAN_SAVE = "    dcp.save(state, checkpoint_id=args.out)\n"
_TUNE_SAVE = '        dcp.save(state, checkpoint_id=os.path.join(self._cfg.output_dir, f"epoch_{epoch}"))\n'
CROSS_MODULE: Tuple[Mutation, ...] = (
    Mutation("xmod-forward-call", "`model.forward(x)` on a model sharded by `parallelize()` of parallel.py",
             _TITAN, "logits = model(tokens)", "logits = model.forward(tokens)", "FSD101"),
    Mutation("xmod-forward-in-helper", "`model.forward(x)` in an evaluate function handed the model sharded in "
             "parallel.py", _TITAN, "total += F.cross_entropy(model(tokens)", "total += F.cross_entropy(model.forward(tokens)",
             "FSD101"),
    Mutation("xmod-torch-save", "`torch.save(model.state_dict())` of the model sharded in parallel.py", _TITAN,
             _TITAN_SAVE, '    torch.save(model.state_dict(), args.out + ".pt")\n', "FSD102"),
    Mutation("xmod-torch-save-optimizer", "`torch.save` of the state of an optimizer over the parameters of the model "
             "sharded in parallel.py", _TITAN, _TITAN_SAVE, '    torch.save(optimizer.state_dict(), args.out + ".pt")\n',
             "FSD102"),
    Mutation("xmod-optimizer-before-shard", "the optimizer built before `parallelize(model, mesh)` shards the model",
             _TITAN, "    model = parallelize(Transformer(ModelArgs()), mesh)\n    optimizer = build_optimizer(model, 3e-4)\n",
             "    model = Transformer(ModelArgs())\n    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)\n"
             "    parallelize(model, mesh)\n", "FSD103"),
    Mutation("xmod-eval-gated", "evaluation of the model sharded in parallel.py only on rank 0", _TITAN,
             "            val_loss = evaluate(model, val_batches)\n            if rank == 0:\n",
             "            if rank == 0:\n                val_loss = evaluate(model, val_batches)\n", "FSD110"),
    Mutation("xmod-local-grad-norm", "the clip_grad_norm_ total of the model sharded in parallel.py read without "
             "`.full_tensor()`", _TITAN, "        norm = norm.full_tensor()\n", "", "FSD107"),
    Mutation("xmod-load-torch-load", "`load_state_dict(torch.load(...))` into the model sharded in parallel.py",
             _TITAN, "    optimizer = build_optimizer(model, 3e-4)\n",
             "    optimizer = build_optimizer(model, 3e-4)\n    model.load_state_dict(torch.load(args.out + \".pt\"))\n",
             "FSD112"),
    Mutation("xmod-cast-after-shard", "`model.to(torch.bfloat16)` after parallel.py sharded it", _TITAN,
             "    optimizer = build_optimizer(model, 3e-4)\n",
             "    model.to(torch.bfloat16)\n    optimizer = build_optimizer(model, 3e-4)\n", "FSD114"),
    Mutation("xmod-no-sync", "DDP's `model.no_sync()` on the model sharded in parallel.py", _TITAN,
             "        loss.backward()\n", "        with model.no_sync():\n            loss.backward()\n", "FSD105"),
    Mutation("xmod-method-forward", "`self._model.forward(x)` in a recipe's train method, the model sharded by "
             "the package's shard_model in _setup_model", _TUNE, "logits = self._model(tokens)",
             "logits = self._model.forward(tokens)", "FSD101"),
    Mutation("xmod-method-torch-save", "`torch.save(self._model.state_dict())` in a recipe's save method", _TUNE,
             _TUNE_SAVE, '        torch.save(self._model.state_dict(), f"model_{epoch}.pt")\n', "FSD102"),
    Mutation("xmod-method-optimizer-before-shard", "the optimizer built in _setup_model before shard_model shards "
             "the model", _TUNE, "        shard_model(model, mesh=self._mesh,",
             "        self._optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)\n"
             "        shard_model(model, mesh=self._mesh,", "FSD103"),
    Mutation("xmod-method-load-torch-load", "`self._model.load_state_dict(torch.load(path))` in a recipe's "
             "load method", _TUNE, '        set_model_state_dict(self._model, state["model"])\n',
             "        self._model.load_state_dict(torch.load(path))\n", "FSD112"),
    Mutation("xmod-method-save-gated", "the recipe's DCP save only on rank 0", _TUNE,
             "            self.save_checkpoint(epoch)\n",
             "            if self._is_rank_zero:\n                self.save_checkpoint(epoch)\n", "FSD110"),
    Mutation("xmod-method-zero-grad", "`self._model.zero_grad()` between the forward and the backward", _TUNE,
             "                loss.backward()\n", "                self._model.zero_grad()\n                loss.backward()\n",
             "FSD113"),
    Mutation("xmod-star-forward-in-function", "`net.forward(x)` in a validation function handed the alias of a "
             "model sharded by a star-imported helper", _LINGUA, "F.cross_entropy(net(tokens)",
             "F.cross_entropy(net.forward(tokens)", "FSD101"),
    Mutation("xmod-star-alias-forward", "`lm.forward(x)` on an alias of the model sharded by a star-imported helper",
             _LINGUA, "F.cross_entropy(lm(tokens)", "F.cross_entropy(lm.forward(tokens)", "FSD101"),
    Mutation("xmod-star-torch-save", "`torch.save(lm.state_dict())` of the alias", _LINGUA,
             '    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out_dir)\n',
             '    torch.save(lm.state_dict(), out_dir + ".pt")\n', "FSD102"),
    Mutation("xmod-star-validate-gated", "validation (a forward of the sharded alias) only on rank 0", _LINGUA,
             "            val_loss = validate(lm, val_batches)\n            if rank == 0:\n",
             "            if rank == 0:\n                val_loss = validate(lm, val_batches)\n", "FSD110"),
    Mutation("xmod-star-step-gated", "the optimizer step over the sharded alias's parameters only on rank 0",
             _LINGUA, "        optimizer.step()\n", _gate("        optimizer.step()"), "FSD110"),
    Mutation("xmod-star-batchnorm", "BatchNorm in the model a star-imported helper shards", _LINGUA,
             "        self.head = nn.Linear(dim, vocab)\n",
             "        self.head = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(dim, vocab))\n", "FSD118"),
    # issue 31: misses found on expert FSDP2 codebases
    Mutation("xmod-shard-moduledict", "`fully_shard` of an nn.ModuleDict of experts whose class (the model's) is in "
             "model.py", _MOE, "    for expert in model.experts.values():\n        fully_shard(expert, mesh=mesh)\n",
             "    fully_shard(model.experts, mesh=mesh)\n", "FSD109"),
    Mutation("xmod-local-grad-norm-float", "`float(clip_grad_norm_(...))`: the norm read as a number at once",
             _MOE, "        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        norm = norm.full_tensor()\n",
             "        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))\n", "FSD107"),
    # a script of a nested package (`apps.lm`) of a project with no root marker, importing the
    # sharding helper from a package beside `apps/` (lingua's layout)
    Mutation("xmod-pkg-forward-call", "`model.forward(x)` on the model sharded by a helper of a package beside the "
             "script's outermost package", _NESTED, "logits = model(ids[:, :-1])", "logits = model.forward(ids[:, :-1])",
             "FSD101"),
    Mutation("xmod-pkg-zero-grad", "`model.zero_grad()` between the forward and backward of that model", _NESTED,
             "        loss.backward()\n", "        model.zero_grad()\n        loss.backward()\n", "FSD113"),
    Mutation("xmod-pkg-torch-save", "`torch.save(model.state_dict())` of that model", _NESTED,
             '    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out)\n',
             '    torch.save(model.state_dict(), out + ".pt")\n', "FSD102"),
    # `self.engine = self.model` after a helper of another module sharded `self.model` in place (verl's
    # SFT trainer), the forward in a method of its own (torchtune's _loss_step)
    Mutation("xmod-attr-zero-grad", "`self.engine.zero_grad()` before the backward, the forward run by "
             "`self._loss_of(batch)`", _STRATEGY, "        loss.backward()\n",
             "        self.engine.zero_grad()\n        loss.backward()\n", "FSD113"),
    Mutation("xmod-attr-torch-save", "`torch.save(self.engine.state_dict())`, `self.engine` the model sharded in "
             "place", _STRATEGY, "        dcp.save(state, checkpoint_id=path)\n",
             "        torch.save(self.engine.state_dict(), path)\n", "FSD102"),
    Mutation("xmod-attr-no-sync", "`self.engine.no_sync()` (DDP's) on the branch's FSDP2 module", _STRATEGY,
             "        loss.backward()\n", "        with self.engine.no_sync():\n            loss.backward()\n", "FSD105"),
    Mutation("xmod-attr-forward-call", "`self.engine.forward(x)` in the loss method", _STRATEGY,
             "self.engine(x.cuda())", "self.engine.forward(x.cuda())", "FSD101"),
    # the model's class shards itself in a method (`fully_shard(self)`), called by a helper of another
    # module on each element of an annotated list of model parts (OLMo-core's apply_fsdp)
    Mutation("xmod-self-method-forward-call", "`self.model.forward(x)`, the model sharded by its own method "
             "through parallelize()", _METHOD, "return self.model(ids)", "return self.model.forward(ids)", "FSD101"),
    Mutation("xmod-self-method-zero-grad", "`self.model.zero_grad()` before the backward, the forward run by "
             "`self.model_forward(...)`", _METHOD, "            loss.backward()\n",
             "            self.model.zero_grad()\n            loss.backward()\n", "FSD113"),
    Mutation("xmod-self-method-torch-save", "`torch.save(self.model.state_dict())` of that model", _METHOD,
             "        dcp.save(state, checkpoint_id=path)\n", "        torch.save(self.model.state_dict(), path)\n",
             "FSD102"),
    Mutation("xmod-self-method-param-forward", "`model.forward(x)` after a helper whose annotated parameter's "
             "class shards it", _METHOD_EVAL, "F.cross_entropy(model(ids[:, :-1])",
             "F.cross_entropy(model.forward(ids[:, :-1])", "FSD101"),
    Mutation("xmod-self-method-built-torch-save", "`torch.save(model.state_dict())` of a model built in the script "
             "and sharded by its class's own method", _METHOD_PROBE, "        return [model(ids).argmax(-1) for ids in batches]\n",
             "        out = [model(ids).argmax(-1) for ids in batches]\n    torch.save(model.state_dict(), \"probe.pt\")\n"
             "    return out\n", "FSD102"),
    # the sharding function is a callable FIELD of a project record, filled where each model package
    # registers it (torchtitan's ModelSpec.parallelize_fn; analysis/record_fields.py)
    Mutation("xmod-record-field-forward", "`model_parts[0].forward(x)`, the model sharded by `recipe.shard_fn(...)`, "
             "a dataclass field a model package fills with its sharding function", _REGISTRY,
             "logits = model_parts[0](tokens)", "logits = model_parts[0].forward(tokens)", "FSD101"),
    Mutation("xmod-record-field-torch-save", "`torch.save(model_parts[0].state_dict())` of that model", _REGISTRY,
             "        loss.backward()\n", "        loss.backward()\n        torch.save(model_parts[0].state_dict(), "
             "\"model.pt\")\n", "FSD102"),
    Mutation("xmod-record-attr-forward", "`nets[\"main\"].forward(x)`, the model sharded in place by "
             "`bp.distribute(net, mesh)`, a plain class's annotated field set by attribute assignment",
             _REGISTRY_ALT, "out = nets[\"main\"](x)", "out = nets[\"main\"].forward(x)", "FSD101"),
    Mutation("xmod-record-attr-torch-save", "`torch.save(nets[\"main\"].state_dict())` of that model", _REGISTRY_ALT,
             "        optimizer.step()\n", "        torch.save(nets[\"main\"].state_dict(), \"model.pt\")\n"
             "        optimizer.step()\n", "FSD102"),
)
MUTATIONS = MUTATIONS + CROSS_MODULE


# The blind rows' figure at their one measurement (commit 4bf5fe7), before any rule was changed for them
BLIND_MEASURED = "9/11 (82%)"

# Planted rows whose expected rule does not catch them (tests/test_check_recall.py checks
# this list both ways: a row missed that is not here, or caught that is, fails).
KNOWN_MISSES = frozenset({
})


# The cause of each corpus failure, read from its row's detail and its rewritten output.
CORPUS_CAUSES: Dict[str, CorpusCause] = {
    "yunjey/convolutional_neural_network": CorpusCause(
        "BatchNorm2d in training mode: batch statistics per rank after the split", "FSD118"),
    "yunjey/variational_autoencoder": CorpusCause(
        "sum-reduced loss (`binary_cross_entropy(..., size_average=False)`): averaged gradients of per-rank sums "
        "are not the single run's", "FSD119"),
    "yunjey/generative_adversarial_network": CorpusCause(
        "`images.reshape(batch_size, -1)` with the loader's batch size: the per-rank shard ends in a partial "
        "batch (shape error)", "FSD120"),
    "yunjey/language_model": CorpusCause(
        "data not split: no DataLoader, every rank trains on the same windows of one tensor (a pattern the "
        "no_dataloader golden keeps on purpose: no lint can tell the two apart)", None),
    "yunjey/pytorch_basics": CorpusCause(
        "training inputs drawn by unseeded `torch.randn` on each rank (the single run's data cannot be "
        "reproduced); FSD114 reports a real later defect (`resnet.fc` replaced after fully_shard) that verify "
        "never reaches", None),
}


# Findings on goldens that are real defects of the golden (read, and explained), not false
# positives of the rule: (fixture, code) -> why. Each is a gap of `rewrite` to fix there.
GOLDEN_DEFECTS: Dict[Tuple[str, str], str] = {  # (fixture, code) -> why the golden really has that defect
    ("param_numpy_logging", "FSD117"): "the fixture keeps `.numpy()` of each parameter every --log-every steps; no "
    "stage can place the `.full_tensor()` gather, so the rewrite leaves the line and names it in its report (an "
    "attention item from this very rule); tests/test_output_check.py runs the golden with the branch taken and "
    "sees the crash",
    ("batch_size_shaped_tensors", "FSD120"): "the fixture shapes tensors by the loader's nominal batch size in the "
    "loop; after the split a rank's last batch can be partial where the single run's were full, and which tensor "
    "of the batch gives the right size needs a person, so the rewrite leaves the lines and names them in its "
    "report (the data stage's FSD120 attention items)",
}


def default_rules():
    from fsdp2_retrofit.check.rules import selected

    return selected([], [])


def findings(text: str, path: str, rules=None) -> List:
    from fsdp2_retrofit.check.lint import lint_source

    result = lint_source(text.encode(), path, rules if rules is not None else default_rules())
    if result.error is not None:
        raise RuntimeError(f"{path}: {result.error}")
    return result.findings


def golden(fixture: str) -> Path:
    """A rewrite fixture's expected.py, or a file of a check project (`projects/...`)."""
    if fixture.startswith("projects/"):
        return PROJECTS.parent / fixture
    return FIXTURES / fixture / "expected.py"


def mutate(m: Mutation) -> str:
    """The golden of `m.fixture` with its one edit; ValueError unless `old` occurs exactly once."""
    text = golden(m.fixture).read_text()
    count = text.count(m.old)
    if count != 1:
        raise ValueError(f"{m.id}: the edit's old text occurs {count} times in {m.fixture}/expected.py")
    return text.replace(m.old, m.new)


def goldens() -> List[Path]:
    return sorted(FIXTURES.glob("*/expected.py")) + sorted(PROJECTS.glob("**/*.py"))


def _golden_name(path: Path) -> str:
    """The name a golden goes by in the tables: its fixture, or its path under fixtures/check."""
    return path.relative_to(PROJECTS.parent).as_posix() if PROJECTS in path.parents else path.parent.name


@dataclass
class Row:
    id: str
    defect: str
    expect: Optional[str]
    reported: List[str]
    caught: bool


def run_goldens() -> List[Tuple[str, List]]:
    """(fixture, findings) for every golden that has findings: false positives."""
    out = []
    for path in goldens():
        found = findings(path.read_text(), str(path))
        if found:
            out.append((_golden_name(path), found))
    return out


def run_planted() -> List[Row]:
    rows = []
    for m in MUTATIONS:
        found = findings(mutate(m), str(golden(m.fixture)))
        codes = sorted({f.code for f in found})
        rows.append(Row(f"{m.fixture}:{m.id}", m.defect, m.expect, codes, m.expect is not None and m.expect in codes))
    return rows


def corpus_failures(realworld: Path) -> List[dict]:
    results = json.loads((realworld / "results" / "results.json").read_text())
    out = []
    for row in results["scripts"]:
        verdict = row.get("verdict")
        if verdict == "crash" and str(row.get("detail", "")).startswith("RECIPE"):
            continue  # the original itself fails in one process
        if verdict in ("crash", "silently-wrong"):
            out.append(row)
    return out


def run_parity(realworld: Path) -> List[Tuple[str, List]]:
    """(row id, findings) for every corpus row whose verdict is parity: correct outputs."""
    results = json.loads((realworld / "results" / "results.json").read_text())
    out = []
    for row in results["scripts"]:
        if row.get("verdict") != "parity":
            continue
        files = sorted((realworld / "work" / row["id"] / "rewritten").glob("**/*.py"))
        if files:
            out.append((row["id"], [f for p in files for f in findings(p.read_text(), str(p))]))
    return out


def run_corpus(realworld: Path) -> List[Row]:
    rows = []
    for row in corpus_failures(realworld):
        cause = CORPUS_CAUSES.get(row["id"])
        files = sorted((realworld / "work" / row["id"] / "rewritten").glob("**/*.py"))
        codes = sorted({f.code for p in files for f in findings(p.read_text(), str(p))})
        detail = (row.get("first_error") or row.get("detail") or "").splitlines()[0][:90]
        if cause is None:
            rows.append(Row(row["id"], f"cause not named ({row['verdict']}: {detail})", None, codes, False))
        elif not files:
            rows.append(Row(row["id"], cause.cause + " (no rewritten output in the work dir)", cause.expect, [], False))
        else:
            caught = cause.expect is not None and cause.expect in codes
            rows.append(Row(row["id"], f"{row['verdict']}: {cause.cause}", cause.expect, codes, caught))
    return rows


def _pct(rows: Sequence[Row]) -> str:
    n = sum(r.caught for r in rows)
    return f"{n}/{len(rows)} ({100 * n / len(rows):.0f}%)" if rows else "0/0"


def _table(rows: Sequence[Row]) -> List[str]:
    lines = ["| case | defect | expected rule | rules reported | caught |", "|---|---|---|---|---|"]
    for r in rows:
        cell = r.defect.replace("|", "\\|")
        lines.append(f"| `{r.id}` | {cell} | {r.expect or '(no rule)'} | {', '.join(r.reported) or '-'} | "
                     f"{'yes' if r.caught else '**no**'} |")
    return lines


def report(planted: Sequence[Row], corpus: Optional[Sequence[Row]], false_pos, n_goldens: int, parity=None,
           codebases: Sequence[str] = ()) -> str:
    lines = ["# Recall of `fsdp2-retrofit check`", "",
             "Generated by `python benchmarks/check_recall.py` (static: nothing runs, torch is not imported).", "",
             "History: with the catalogue of the time (FSD101-FSD117) `check` caught 26/36 of the first 36 "
             "planted rows and 0/5 corpus failures; the last 5 planted rows, added later, 1/5. Each rule added or "
             "widened since was written after seeing which rows it missed, so the figures below are not "
             "out-of-sample: the ones before are, and so is the blind rows' figure when they were measured once "
             f"({BLIND_MEASURED}); session 24 then widened FSD103 and FSD120 for the two it missed, so the blind rows' "
             "figure today is in-sample.", ""]
    lines.append(f"- planted defects caught: {_pct(planted)}")
    blind = [r for r, m in zip(planted, MUTATIONS) if m.blind]
    if blind:
        lines.append(f"- of which blind rows (written after the rules): {_pct(blind)}; out-of-sample, when measured "
                     f"once: {BLIND_MEASURED}")
    if corpus is not None:
        lines.append(f"- corpus failures caught (crash without RECIPE, silently-wrong): {_pct(corpus)}")
        both = list(planted) + list(corpus)
        lines.append(f"- all together: {_pct(both)}")
    real = [(name, f) for name, found in false_pos for f in found if (name, f.code) in GOLDEN_DEFECTS]
    wrong = [(name, f) for name, found in false_pos for f in found if (name, f.code) not in GOLDEN_DEFECTS]
    lines.append(f"- findings on the {n_goldens} fixture goldens (the correct outputs): {len(real) + len(wrong)}; "
                 f"false positives: {len(wrong)}; real defects of the golden (explained below): {len(real)}")
    if parity is not None:
        found = sum(len(f) for _, f in parity)
        lines.append(f"- findings on the corpus rows with verdict parity (correct outputs too): {found} "
                     f"in {len(parity)} row(s) checked")
    lines += ["", "## Planted defects (one edit of one golden each)", ""] + _table(planted)
    if corpus is not None:
        lines += ["", "## Real-world corpus failures", ""] + _table(corpus)
    if false_pos:
        lines += ["", "## Findings on the goldens", ""]
        for name, found in false_pos:
            for f in found:
                why = GOLDEN_DEFECTS.get((name, f.code))
                verdict = f"real defect: {why}" if why else "**false positive**"
                lines.append(f"- `{name}` {f.code} line {f.line}: {f.message} ({verdict})")
    if parity:
        lines += ["", "## Findings on corpus parity rows", ""]
        for name, found in parity:
            lines.append(f"- `{name}`: " + ("; ".join(f"{f.code} line {f.line}: {f.message}" for f in found) or "none"))
    if codebases:
        lines += [""] + list(codebases)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--realworld", type=Path, default=None,
                   help="the corpus folder with results/results.json and work/ (default: this repo's, else /work/main's)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-corpus", action="store_true")
    p.add_argument("--codebases", type=Path, default=None, metavar="MIRRORS",
                   help="a folder of bare git mirrors (owner+name/repo): adds the real-codebase tables")
    args = p.parse_args(argv)
    realworld = args.realworld
    if realworld is None:
        for candidate in (REPO / "benchmarks" / "realworld", Path("/work/main/benchmarks/realworld")):
            if (candidate / "work").is_dir() and (candidate / "results" / "results.json").is_file():
                realworld = candidate
                break
    false_pos = run_goldens()
    planted = run_planted()
    corpus = parity = None
    if not args.no_corpus and realworld is not None:
        corpus, parity = run_corpus(realworld), run_parity(realworld)
    codebases: List[str] = []
    if args.codebases is not None:
        import check_codebases

        codebases = check_codebases.report_lines(check_codebases.measure(args.codebases))
    text = report(planted, corpus, false_pos, len(goldens()), parity, codebases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
