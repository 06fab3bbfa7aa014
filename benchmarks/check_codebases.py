"""Precision and recall of `fsdp2-retrofit check` on real FSDP2 codebases, at pinned commits.

    python benchmarks/check_recall.py --codebases MIRRORS

MIRRORS holds bare git mirrors named `owner+name/repo` (the layout the team's fetch tool writes;
`git clone --mirror https://github.com/owner/name MIRRORS/owner+name/repo` makes one). Each
codebase's Python files at its pinned commit are extracted to a temporary folder (`git archive`),
`check` runs over the tree from its root, and every finding is looked up in FINDINGS below.
Nothing of those codebases is stored here: the tables name files, lines and rules, and the
planted defects are regular expressions of ours applied to the extracted copy.

How a finding is classified (the rule, written down before the counts were read):

* true: on a path the codebase runs with FSDP2 (`fully_shard`), the flagged line as written
  breaks training (a crash or a hang), silently changes what is trained or logged, or saves or
  loads state that no other rank can read;
* false: the line is not reached under FSDP2 (an FSDP1 branch beside the FSDP2 one, a
  single-device recipe, a test of FSDP1 itself), the premise of the rule does not hold there
  (the value is not a DTensor, the module is not sharded, the device is set elsewhere before
  any CUDA work: a wrapper, a base class, a later line), or the code is vendored library code
  that handles FSDP1 on purpose.

FSD111 (FSDP1 API) is a migration note, not a run-time defect, and it promises to fire only where
FSDP1 is a file's only path: its finding is true there (the file has no FSDP2 path to fall back
on), false where an FSDP2 path sits beside it or the code handles FSDP1 on purpose. A test of
FSDP1 itself handles FSDP1 on purpose: its findings, counted true before FSD401 existed, are false
as errors since (FSD401, off by default, notes them for a migration).

A finding missing from FINDINGS is reported as unclassified and counts against precision
(it has not been shown to be true). A planted defect is caught when its expected rule is among
the findings on the planted line's file, checked in place (beside its modules).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Codebase:
    repo: str  # owner/name
    commit: str  # pinned: line numbers in FINDINGS refer to it


CODEBASES: Tuple[Codebase, ...] = (
    Codebase("pytorch/torchtitan", "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"),
    Codebase("pytorch/torchtune", "bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1"),
    Codebase("allenai/OLMo-core", "fa6c5014c9f6e9ee789da2d9c20d5126fee8df0d"),
    Codebase("facebookresearch/lingua", "437d680e521873bb5971067148a69587790da853"),
    Codebase("volcengine/verl", "b178a3cd56f58b2d502255daba591e92833930a7"),
    Codebase("axolotl-ai-cloud/axolotl", "067b021c8b87a9e5e380b9173c704cf7340e30f5"),
)


@dataclass(frozen=True)
class Verdict:
    true: bool
    why: str


_FSDP1_BRANCH = "FSDP1 in a branch beside the FSDP2 one (a strategy switch): not reached under fully_shard"
_FSDP1_ONLY = ("a test of FSDP1 models: FSDP1 on purpose, an FSD401 note (off by default) since FSD111 leaves test "
               "modules alone (counted true before)")
_VENDORED = "vendored torch code that handles FSDP1 modules on purpose, behind isinstance checks"
_DEVICE_SET = "the device is set before any CUDA work elsewhere: "

# (repo, path, line, code) -> verdict, from reading each finding at the pinned commit. Findings of
# earlier versions of the rules stay listed (the table shows the ones no longer reported).
FINDINGS: Dict[Tuple[str, str, int, str], Verdict] = {
    ("allenai/OLMo-core", "src/olmo_core/nn/transformer/block.py", 848, "FSD104"): Verdict(
        False, "the two fully_shard calls of the submodules are in exclusive branches; the root is sharded after both"),
    ("allenai/OLMo-core", "src/test/distributed/checkpoint_test.py", 32, "FSD111"): Verdict(False, _FSDP1_ONLY),
    ("allenai/OLMo-core", "src/test/distributed/checkpoint_test.py", 44, "FSD111"): Verdict(False, _FSDP1_ONLY),
    ("allenai/OLMo-core", "src/test/distributed/checkpoint_test.py", 49, "FSD111"): Verdict(False, _FSDP1_ONLY),
    ("axolotl-ai-cloud/axolotl", "src/axolotl/monkeypatch/accelerate/fsdp2.py", 444, "FSD111"): Verdict(
        False, "the FSDP1 branch of a distributed-type switch (`elif ... == DistributedType.FSDP`)"),
    ("pytorch/torchtitan", "scripts/checkpoint_conversion/numerical_tests_qwen3_5_shard.py", 46, "FSD106"): Verdict(
        False, _DEVICE_SET + "set_device on the line after init_process_group"),
    ("pytorch/torchtune", "recipes/dev/early_exit_finetune_distributed.py", 185, "FSD106"): Verdict(
        False, _DEVICE_SET + "utils.get_device() in __init__ sets the local rank's device"),
    ("pytorch/torchtune", "recipes/dev/grpo_full_finetune_distributed.py", 55, "FSD106"): Verdict(
        False, _DEVICE_SET + "utils.get_device() in __init__ sets the local rank's device"),
    ("pytorch/torchtune", "recipes/dev/grpo_full_finetune_distributed.py", 876, "FSD107"): Verdict(
        True, "the clip_grad_norm_ total of the sharded model goes to the metric logger without .full_tensor() "
        "(the main distributed recipe gathers it first)"),
    ("pytorch/torchtune", "recipes/dev/grpo_full_finetune_distributed.py", 877, "FSD107"): Verdict(
        True, "the clip_grad_norm_ total of the sharded model stored in the metrics without .full_tensor() "
        "(the main distributed recipe gathers it first)"),
    ("pytorch/torchtune", "recipes/full_dpo_distributed.py", 156, "FSD106"): Verdict(
        False, _DEVICE_SET + "utils.get_device() in __init__ sets the local rank's device"),
    ("pytorch/torchtune", "recipes/full_finetune_distributed.py", 151, "FSD106"): Verdict(
        False, _DEVICE_SET + "utils.get_device() in __init__ sets the local rank's device"),
    ("pytorch/torchtune", "recipes/full_finetune_single_device.py", 660, "FSD107"): Verdict(
        False, "a single-device recipe: its model is never sharded, the norm is a plain tensor"),
    ("pytorch/torchtune", "recipes/qat_distributed.py", 160, "FSD106"): Verdict(
        False, _DEVICE_SET + "utils.get_device() in __init__ sets the local rank's device"),
    ("pytorch/torchtune", "torchtune/modules/embedding_utils.py", 116, "FSD114"): Verdict(
        False, "the single-device resize helper; the sharded model takes another path"),
    ("pytorch/torchtune", "torchtune/modules/embedding_utils.py", 131, "FSD114"): Verdict(
        False, "the single-device resize helper; the sharded model takes another path"),
    ("pytorch/torchtune", "torchtune/dev/rl/workers/trainers/training.py", 79, "FSD106"): Verdict(
        False, _DEVICE_SET + "a Ray actor (one visible GPU each); utils.get_device() sets it in __init__"),
    ("pytorch/torchtune", "torchtune/training/_distributed.py", 280, "FSD106"): Verdict(
        False, _DEVICE_SET + "a library helper; its callers set the device"),
    ("volcengine/verl", "tests/models/test_tiled_mlp_accuracy.py", 27, "FSD106"): Verdict(
        False, _DEVICE_SET + "set_device right after init_process_group"),
    ("volcengine/verl", "tests/special_distributed/test_fsdp_ckpt.py", 70, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "tests/utils/test_activation_offload.py", 54, "FSD106"): Verdict(
        False, _DEVICE_SET + "set_device(rank) through the device helper just before it"),
    ("volcengine/verl", "tests/utils/test_activation_offload.py", 75, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "tests/workers/rollout/rollout_vllm/run_fsdp_vllm.py", 97, "FSD111"): Verdict(
        False, _FSDP1_ONLY),
    ("volcengine/verl", "tests/workers/rollout/rollout_vllm/run_fsdp_vllm.py", 109, "FSD111"): Verdict(
        False, _FSDP1_ONLY),
    ("volcengine/verl", "tests/workers/rollout/test_hf_rollout.py", 82, "FSD111"): Verdict(False, _FSDP1_ONLY),
    ("volcengine/verl", "tests/workers/rollout/test_hf_rollout.py", 94, "FSD111"): Verdict(False, _FSDP1_ONLY),
    ("volcengine/verl", "verl/experimental/fully_async_policy/fsdp_workers.py", 209, "FSD111"): Verdict(
        False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/experimental/one_step_off_policy/fsdp_workers.py", 151, "FSD111"): Verdict(
        False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/experimental/vla/fsdp_workers.py", 76, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/experimental/vla/fsdp_workers.py", 82, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/third_party/torch/distributed/checkpoint/state_dict.py", 409, "FSD111"): Verdict(
        False, _VENDORED),
    ("volcengine/verl", "verl/third_party/torch/distributed/checkpoint/state_dict.py", 440, "FSD111"): Verdict(
        False, _VENDORED),
    ("volcengine/verl", "verl/third_party/torch/distributed/checkpoint/state_dict.py", 833, "FSD111"): Verdict(
        False, _VENDORED),
    ("volcengine/verl", "verl/third_party/torch/distributed/checkpoint/state_dict.py", 1008, "FSD111"): Verdict(
        False, _VENDORED),
    ("volcengine/verl", "verl/trainer/fsdp_sft_trainer.py", 312, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/utils/fsdp_utils.py", 410, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/utils/fsdp_utils.py", 597, "FSD111"): Verdict(
        False, "guarded by the module's FSDP version; on a fully_shard module it gathers nothing and the "
        "parameters are gathered with .full_tensor() right after"),
    ("volcengine/verl", "verl/utils/fsdp_utils.py", 629, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/actor/dp_actor.py", 96, "FSD111"): Verdict(
        False, "ShardedGradScaler all-reduces found_inf over the ranks: correct under fully_shard too"),
    ("volcengine/verl", "verl/workers/engine/fsdp/transformer_impl.py", 324, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/engine/fsdp/transformer_impl.py", 368, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/engine/fsdp/transformer_impl.py", 374, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 155, "FSD106"): Verdict(
        False, _DEVICE_SET + "the base Worker class sets the local rank's device"),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 529, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 656, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 662, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 1194, "FSD106"): Verdict(
        False, _DEVICE_SET + "the base Worker class sets the local rank's device"),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 1430, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 1651, "FSD106"): Verdict(
        False, _DEVICE_SET + "the base Worker class sets the local rank's device"),
    ("volcengine/verl", "verl/workers/fsdp_workers.py", 1747, "FSD111"): Verdict(False, _FSDP1_BRANCH),
    ("volcengine/verl", "verl/workers/rollout/hf_rollout.py", 110, "FSD111"): Verdict(
        False, "behind `isinstance(self.module, FSDP)`: only FSDP1 modules reach it"),
}


@dataclass(frozen=True)
class Plant:
    id: str
    repo: str
    path: str  # the file edited, relative to the codebase's root
    pattern: str  # a regular expression (MULTILINE) that must match exactly once
    replacement: str  # re.sub's replacement
    expect: str  # the rule code expected to flag it
    defect: str


_TUNE = "recipes/full_finetune_distributed.py"
_LINGUA = "apps/main/train.py"
_TITAN = "torchtitan/trainer.py"
_OLMO = "src/olmo_core/train/train_module/transformer/train_module.py"
_VERL = "verl/trainer/fsdp_sft_trainer.py"

PLANTS: Tuple[Plant, ...] = (
    # torchtune: the recipe's self._model sharded by the package's shard_model in _setup_model
    Plant("tune-forward-call", "pytorch/torchtune", _TUNE, r"self\._model\(\*\*batch\)", "self._model.forward(**batch)",
          "FSD101", "`self._model.forward(...)` in the recipe's train step"),
    Plant("tune-zero-grad", "pytorch/torchtune", _TUNE, r"^(\s*)(current_loss\.backward\(\))$",
          r"\1self._model.zero_grad()\n\1\2", "FSD113", "`self._model.zero_grad()` between forward and backward"),
    Plant("tune-torch-save", "pytorch/torchtune", _TUNE, r"^(\s*)(current_loss\.backward\(\))$",
          r'\1\2\n\1torch.save(self._model.state_dict(), "model.pt")', "FSD102",
          "`torch.save` of the sharded model's state dict"),
    Plant("tune-torch-load", "pytorch/torchtune", _TUNE, r"^(\s*)(current_loss\.backward\(\))$",
          r'\1\2\n\1self._model.load_state_dict(torch.load("model.pt"))', "FSD112",
          "`load_state_dict(torch.load(...))` into the sharded model"),
    Plant("tune-no-sync", "pytorch/torchtune", _TUNE, r"^(\s*)(current_loss\.backward\(\))$",
          r"\1with self._model.no_sync():\n\1    \2", "FSD105", "DDP's `no_sync()` on the FSDP2 module"),
    # through an alias of the attribute (issue 45: `net = self._model; net.forward(x)`)
    Plant("tune-alias-forward-call", "pytorch/torchtune", _TUNE, r"^(\s*)outputs = self\._model\(\*\*batch\)$",
          r"\1net = self._model\n\1outputs = net.forward(**batch)", "FSD101",
          "`net.forward(...)` where `net = self._model`"),
    # lingua: model = parallelize_model(...) of another module of the package
    Plant("lingua-forward-call", "facebookresearch/lingua", _LINGUA, r"loss = model\(input_ids, labels\)",
          "loss = model.forward(input_ids, labels)", "FSD101", "`model.forward(...)` in the train loop"),
    # through a container (issue 45: `model_parts[0].forward(...)`)
    Plant("lingua-container-forward-call", "facebookresearch/lingua", _LINGUA,
          r"^(\s*)loss = model\(input_ids, labels\)$",
          r"\1model_parts = [model]\n\1loss = model_parts[0].forward(input_ids, labels)", "FSD101",
          "`model_parts[0].forward(...)` of a list holding the sharded model"),
    Plant("lingua-zero-grad", "facebookresearch/lingua", _LINGUA, r"^(\s*)(loss\.backward\(\))$",
          r"\1model.zero_grad()\n\1\2", "FSD113", "`model.zero_grad()` between forward and backward"),
    Plant("lingua-torch-save", "facebookresearch/lingua", _LINGUA, r"^(\s*)(loss\.backward\(\))$",
          r'\1\2\n\1torch.save(model.state_dict(), "model.pt")', "FSD102", "`torch.save` of the model's state dict"),
    # torchtitan: the trainer's model parts, sharded through the model spec's parallelize function.
    # `model_spec.parallelize_fn(model, ...)` calls a `Callable` field of ModelSpec, followed by the
    # values the project stores in it (analysis/record_fields.py): 9 ModelSpec(...) constructions
    # hold functions that fully_shard their model, 4 (experiments/graph_trainer/*) functions that
    # shard it with SimpleFSDP; the field is followed when any value shards (caught since session
    # 24; before, the mixed field was not followed). The plants read `self.model_parts[0]` in another
    # method than `self.model_parts = [model]`, the pipeline branch also storing `self.model_parts`
    # by tuple unpacking: a container an attribute holds is read by what any store of the class put
    # there (analysis/flow.py attribute_entries), as a sharded `self.model` counts in every method.
    Plant("titan-forward-call", "pytorch/torchtitan", _TITAN, r"pred = self\.model_parts\[0\]\(inputs",
          "pred = self.model_parts[0].forward(inputs", "FSD101", "`.forward(...)` on the first model part"),
    Plant("titan-torch-save", "pytorch/torchtitan", _TITAN, r"^(\s*)(loss\.backward\(\))$",
          r'\1\2\n\1torch.save(self.model_parts[0].state_dict(), "model.pt")', "FSD102",
          "`torch.save` of a model part's state dict"),
    # Blind rows (session 24): written after the rules of that session were done, measured once, and no
    # rule changed for them after (the figure before any change is the out-of-sample one: see RESULTS.md)
    Plant("blind-verl-alias-forward-call", "volcengine/verl", _VERL,
          r"(# Standard forward pass without sequence parallel\n(\s*)labels = input_ids\[:, 1:\]\.contiguous\(\)\n)"
          r"\s*output = self\.fsdp_model\(",
          r"\1\2net = self.fsdp_model\n\2output = net.forward(", "FSD101",
          "`net.forward(...)` where `net = self.fsdp_model`, in the SFT step"),
    Plant("blind-lingua-dict-forward-call", "facebookresearch/lingua", _LINGUA,
          r"^(\s*)loss = model\(input_ids, labels\)$",
          r'\1models = {"lm": model}\n\1loss = models["lm"].forward(input_ids, labels)', "FSD101",
          '`models["lm"].forward(...)` of a dict holding the sharded model'),
    Plant("blind-titan-return-forward-call", "pytorch/torchtitan", _TITAN,
          r"(\n    def _forward_backward_body\([\s\S]*?)pred = self\.model_parts\[0\]\(inputs",
          r"\n    def _first_part(self):\n        return self.model_parts[0]\n\1pred = self._first_part().forward(inputs",
          "FSD101", "`self._first_part().forward(...)`, a method returning the first model part"),
    Plant("blind-olmo-alias-torch-save", "allenai/OLMo-core", _OLMO, r"^(\s*)(loss\.backward\(\))$",
          r'\1\2\n\1net = self.model\n\1torch.save(net.state_dict(), "model.pt")', "FSD102",
          "`torch.save(net.state_dict())` where `net = self.model`"),
    Plant("blind-tune-container-forward-call", "pytorch/torchtune", _TUNE, r"^(\s*)outputs = self\._model\(\*\*batch\)$",
          r"\1parts = [self._model]\n\1outputs = parts[0].forward(**batch)", "FSD101",
          "`parts[0].forward(...)` of a list holding the recipe's sharded `self._model`"),
    # OLMo-core: the train module's self.model = parallelize_model(...)
    Plant("olmo-forward-call", "allenai/OLMo-core", _OLMO, r"return self\.model\(input_ids, labels=labels",
          "return self.model.forward(input_ids, labels=labels", "FSD101", "`self.model.forward(...)` in model_forward"),
    Plant("olmo-zero-grad", "allenai/OLMo-core", _OLMO, r"^(\s*)(loss\.backward\(\))$",
          r"\1self.model.zero_grad()\n\1\2", "FSD113", "`self.model.zero_grad()` between forward and backward"),
    Plant("olmo-torch-save", "allenai/OLMo-core", _OLMO, r"^(\s*)(loss\.backward\(\))$",
          r'\1\2\n\1torch.save(self.model.state_dict(), "model.pt")', "FSD102", "`torch.save` of the model's state"),
    # verl: the SFT trainer's self.fsdp_model, FSDP1 or fully_shard by strategy
    Plant("verl-zero-grad", "volcengine/verl", _VERL, r"^(\s*)(loss\.backward\(\))$",
          r"\1self.fsdp_model.zero_grad()\n\1\2", "FSD113", "`self.fsdp_model.zero_grad()` between forward and backward"),
    Plant("verl-torch-save", "volcengine/verl", _VERL, r"^(\s*)(loss\.backward\(\))$",
          r'\1\2\n\1torch.save(self.fsdp_model.state_dict(), "model.pt")', "FSD102",
          "`torch.save` of the sharded model's state"),
    Plant("verl-no-sync", "volcengine/verl", _VERL, r"^(\s*)(loss\.backward\(\))$",
          r"\1with self.fsdp_model.no_sync():\n\1    \2", "FSD105", "`no_sync()` on the sharded model"),
)


def _mirror(mirrors: Path, repo: str) -> Path:
    return mirrors / repo.replace("/", "+") / "repo"


def extract(mirrors: Path, cb: Codebase, into: Path) -> Optional[str]:
    """The codebase's Python files at its commit under `into`; None, or why it could not."""
    git_dir = _mirror(mirrors, cb.repo)
    if not git_dir.is_dir():
        return f"no mirror at {git_dir}"
    into.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "--git-dir", str(git_dir), "ls-tree", "-r", "--name-only", cb.commit],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        return listed.stderr.strip().splitlines()[0]
    # the Python files and the project files that say where the packages are (large data files
    # of a mirror may be absent: only these are read)
    wanted = [n for n in listed.stdout.splitlines() if n.endswith((".py", "pyproject.toml", "setup.cfg"))]
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", cb.commit, "--", *wanted],
                             capture_output=True)
    if archive.returncode != 0:
        return archive.stderr.decode(errors="replace").strip().splitlines()[0]
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return None


def run_check(root: Path, paths: Sequence[str] = (".",)) -> List[dict]:
    """Findings of the `check` command run from `root` (JSON records, paths relative to root)."""
    done = subprocess.run([sys.executable, "-m", "fsdp2_retrofit", "check", *paths, "--exit-zero",
                           "--output-format", "json"], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"check failed in {root}: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout or "[]")


def plant(root: Path, p: Plant) -> str:
    """The planted file's new text; ValueError unless the pattern matches exactly once."""
    text = (root / p.path).read_text()
    matches = len(re.findall(p.pattern, text, flags=re.MULTILINE))
    if matches != 1:
        raise ValueError(f"{p.id}: the pattern matches {matches} times in {p.repo}/{p.path}")
    return re.sub(p.pattern, p.replacement, text, flags=re.MULTILINE)


_CALLS_FULLY_SHARD = re.compile(r"\bfully_shard\s*\(")


def _fsdp2_files(root: Path) -> set:
    """The files that call `fully_shard(` (a mention in a docstring or a name that contains it does not count)."""
    return {str(f.relative_to(root)) for f in root.rglob("*.py")
            if _CALLS_FULLY_SHARD.search(f.read_text(errors="replace"))}


@dataclass
class CodebaseResult:
    codebase: Codebase
    error: Optional[str]
    files: int
    fsdp2_files: int
    findings: List[Tuple[str, int, str, str, Optional[Verdict], bool]]  # path, line, code, message, verdict, fsdp2 file
    plants: List[Tuple[Plant, List[str], bool]]  # plant, codes on the file, caught


def measure(mirrors: Path) -> List[CodebaseResult]:
    out = []
    with tempfile.TemporaryDirectory(prefix="fsdp2-codebases-") as tmp:
        for cb in CODEBASES:
            root = Path(tmp) / cb.repo.replace("/", "+")
            error = extract(mirrors, cb, root)
            if error is not None:
                out.append(CodebaseResult(cb, error, 0, 0, [], []))
                continue
            fsdp2 = _fsdp2_files(root)
            rows = []
            for f in run_check(root):
                path, line, code = f["filename"], f["location"]["row"], f["code"]
                rows.append((path, line, code, f["message"], FINDINGS.get((cb.repo, path, line, code)), path in fsdp2))
            plants = []
            for p in (p for p in PLANTS if p.repo == cb.repo):
                original = (root / p.path).read_text()
                (root / p.path).write_text(plant(root, p))
                try:
                    codes = sorted({f["code"] for f in run_check(root, [p.path])})
                finally:
                    (root / p.path).write_text(original)
                plants.append((p, codes, p.expect in codes))
            out.append(CodebaseResult(cb, None, len(list(root.rglob("*.py"))), len(fsdp2), rows, plants))
    return out


def _share(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "0/0"


def report_lines(results: Sequence[CodebaseResult]) -> List[str]:
    rows = [r for res in results for r in res.findings]
    in_fsdp2 = [r for r in rows if r[5]]
    plants = [p for res in results for p in res.plants]
    true_all = sum(1 for r in rows if r[4] is not None and r[4].true)
    true_fsdp2 = sum(1 for r in in_fsdp2 if r[4] is not None and r[4].true)
    lines = ["## Real FSDP2 codebases (pinned commits)", "",
             "Generated by `python benchmarks/check_recall.py --codebases MIRRORS` (benchmarks/check_codebases.py "
             "holds the commits, the classification rule and the verdicts).", "",
             f"- findings that are true positives, in files that call `fully_shard`: {_share(true_fsdp2, len(in_fsdp2))}",
             f"- findings that are true positives, all files: {_share(true_all, len(rows))}",
             f"- unclassified findings (counted as not true): {sum(1 for r in rows if r[4] is None)}",
             f"- planted defects caught in real files (model sharded in another module): "
             f"{_share(sum(p[2] for p in plants), len(plants))}", "",
             "| codebase | commit | .py files | files with fully_shard | findings | in those files | true |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        if res.error:
            lines.append(f"| {res.codebase.repo} | `{res.codebase.commit[:10]}` | not run: {res.error} | | | | |")
            continue
        t = sum(1 for r in res.findings if r[4] is not None and r[4].true)
        lines.append(f"| {res.codebase.repo} | `{res.codebase.commit[:10]}` | {res.files} | {res.fsdp2_files} | "
                     f"{len(res.findings)} | {sum(1 for r in res.findings if r[5])} | {t} |")
    lines += ["", "### Each finding", "", "| codebase | file:line | rule | fully_shard file | verdict | why |",
              "|---|---|---|---|---|---|"]
    for res in results:
        for path, line, code, message, verdict, fsdp2 in res.findings:
            v = "unclassified" if verdict is None else ("true" if verdict.true else "**false**")
            why = (verdict.why if verdict else message).replace("|", "\\|")
            lines.append(f"| {res.codebase.repo} | `{path}:{line}` | {code} | {'yes' if fsdp2 else 'no'} | {v} | {why} |")
    reported = {(res.codebase.repo, r[0], r[1], r[2]) for res in results for r in res.findings}
    ran = {res.codebase.repo for res in results if not res.error}
    gone = [(k, v) for k, v in FINDINGS.items() if k[0] in ran and k not in reported]
    if gone:
        lines += ["", f"### Classified findings of earlier rule versions, no longer reported ({len(gone)}: "
                  f"{sum(1 for _, v in gone if v.true)} true, {sum(1 for _, v in gone if not v.true)} false)", "",
                  "| codebase | file:line | rule | verdict | why |", "|---|---|---|---|---|"]
        for (repo, path, line, code), v in gone:
            lines.append(f"| {repo} | `{path}:{line}` | {code} | {'true (a miss now)' if v.true else 'false'} | "
                         f"{v.why.replace('|', chr(92) + '|')} |")
    lines += ["", "### Planted defects in real files", "", "| case | file | defect | expected | reported | caught |",
              "|---|---|---|---|---|---|"]
    for res in results:
        for p, codes, caught in res.plants:
            lines.append(f"| `{p.id}` | {p.repo}/{p.path} | {p.defect.replace('|', chr(92) + '|')} | {p.expect} | "
                         f"{', '.join(codes) or '-'} | {'yes' if caught else '**no**'} |")
    return lines
