"""`from models import *`: the names a script's star imports of its own modules bind
(analysis/star_imports.py), and what the rewrite and `check` make of them."""
from __future__ import annotations

from pathlib import Path

import libcst as cst

from fsdp2_retrofit.analysis.facts import analyse
from fsdp2_retrofit.analysis.model_classes import build_registry, recording_reads
from fsdp2_retrofit.check.lint import LintContext
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import Resolver

NET = '''\
import torch.nn as nn


class {name}(nn.Module):
    def __init__(self, channels=3):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
'''

SCRIPT = '''\
import torch
from torch.utils.data import DataLoader, TensorDataset
{imports}

generator = {build}
if torch.cuda.is_available():
    generator = generator.cuda()
optimizer = torch.optim.Adam(generator.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 4)), batch_size=4, shuffle=True)
for x, y in loader:
    loss = ((generator(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(generator.state_dict(), "out.pt")
'''


def _write(folder: Path, files: dict) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _registry(folder: Path, script: str):
    path = folder / "train.py"
    path.write_text(script)
    module = cst.parse_module(script)
    resolver = Resolver(module)
    return build_registry(module, resolver, str(path)), resolver


def _call_name(resolver: Resolver, source_name: str):
    return resolver.qnames(cst.Name(source_name))


def _rewrite(folder: Path, script: str):
    path = folder / "train.py"
    path.write_text(script)
    return rewrite_source(script.encode(), str(path))


def test_a_class_of_a_star_imported_sibling_is_a_model(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    registry, resolver = _registry(tmp_path, "from models import *\n")
    assert _call_name(resolver, "Generator") == {"models.Generator"}
    assert registry.is_module_class("models.Generator")
    assert _call_name(resolver, "nn") == {"torch.nn"}  # what models.py imports is exported too


def test_a_package_re_exports_its_modules_by_star_import(tmp_path):
    _write(tmp_path, {
        "models/__init__.py": "from .vgg import *\nfrom .dla_simple import *\n",
        "models/vgg.py": NET.format(name="VGG"),
        "models/dla_simple.py": NET.format(name="SimpleDLA"),
    })
    registry, resolver = _registry(tmp_path, "from models import *\n")
    assert _call_name(resolver, "SimpleDLA") == {"models.dla_simple.SimpleDLA"}
    assert registry.is_module_class("models.dla_simple.SimpleDLA")
    assert [c.path for c in registry.block_containers("models.dla_simple.SimpleDLA")] == [("blocks",)]


def test_a_package_re_exporting_by_name(tmp_path):
    _write(tmp_path, {
        "models/__init__.py": "from .resnet import ResNet18\n",
        "models/resnet.py": NET.format(name="ResNet18") + NET.format(name="Hidden").split("\n", 2)[2],
    })
    registry, resolver = _registry(tmp_path, "from models import *\n")
    assert _call_name(resolver, "ResNet18") == {"models.resnet.ResNet18"}
    assert registry.is_module_class("models.resnet.ResNet18")
    assert _call_name(resolver, "Hidden") == set()  # not imported by __init__.py


def test_dunder_all_limits_what_a_star_import_binds(tmp_path):
    _write(tmp_path, {"models.py": '__all__ = ["Generator"]\n' + NET.format(name="Generator")
                      + NET.format(name="Critic").split("\n", 2)[2] + "\n_private = 1\n"})
    registry, resolver = _registry(tmp_path, "from models import *\n")
    assert _call_name(resolver, "Generator") == {"models.Generator"}
    assert _call_name(resolver, "Critic") == set()
    assert _call_name(resolver, "nn") == set()


def test_leading_underscore_names_are_not_exported(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="_Net")})
    _, resolver = _registry(tmp_path, "from models import *\n")
    assert _call_name(resolver, "_Net") == set()


def test_a_class_two_star_imports_bind_is_not_guessed(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator"), "datasets.py": NET.format(name="Generator")})
    registry, resolver = _registry(tmp_path, "from models import *\nfrom datasets import *\n")
    assert _call_name(resolver, "Generator") == set()
    why = registry.star.why_unresolved("Generator")
    assert "`from models import *` (line 1)" in why and "`from datasets import *` (line 2)" in why


def test_the_same_object_through_two_star_imports_is_fine(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator"), "train_utils.py": "from models import Generator\n"})
    _, resolver = _registry(tmp_path, "from models import *\nfrom train_utils import *\n")
    assert _call_name(resolver, "Generator") == {"models.Generator"}


def test_a_star_import_of_a_library_after_the_sibling_may_replace_its_names(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    registry, resolver = _registry(tmp_path, "from models import *\nfrom torchvision.models import *\n")
    assert _call_name(resolver, "Generator") == set()
    assert "may be replaced by `from torchvision.models import *` (line 2)" in registry.star.why_unresolved("Generator")


def test_a_star_import_of_a_library_before_the_sibling_cannot_replace_its_names(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    _, resolver = _registry(tmp_path, "from torchvision.models import *\nfrom models import *\n")
    assert _call_name(resolver, "Generator") == {"models.Generator"}


def test_a_class_the_script_defines_after_the_star_import_is_its_own(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    script = "from models import *\n" + NET.format(name="Generator")
    registry, resolver = _registry(tmp_path, script)
    assert _call_name(resolver, "Generator") == {"Generator"}  # Python runs the class statement last
    assert registry.star.why_unresolved("Generator") is None


def test_a_name_the_script_binds_before_a_star_import_rebinding_it_is_not_guessed(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    script = NET.format(name="Generator") + "from models import *\n"
    registry, resolver = _registry(tmp_path, script)
    assert _call_name(resolver, "Generator") == set()
    assert "by the script itself (line 4), before the star import" in registry.star.why_unresolved("Generator")
    assert _call_name(resolver, "nn") == {"torch.nn"}  # the same module either way


def test_a_conditional_star_import_is_not_guessed(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    registry, resolver = _registry(tmp_path, "try:\n    from models import *\nexcept ImportError:\n    pass\n")
    assert _call_name(resolver, "Generator") == set()
    assert "runs only in some cases" in registry.star.why_unresolved("Generator")


def test_a_computed_dunder_all_leaves_the_names_unknown(tmp_path):
    _write(tmp_path, {"models.py": "__all__ = [n for n in dir() if n[0] != '_']\n" + NET.format(name="Generator")})
    registry, resolver = _registry(tmp_path, "from models import *\n")
    assert _call_name(resolver, "Generator") == set()
    assert "computed `__all__` of models.py" in registry.star.why_unresolved("Generator")


def test_the_files_read_through_star_imports_are_inputs_of_the_rewrite(tmp_path):
    _write(tmp_path, {"models/__init__.py": "from .dla import *\n", "models/dla.py": NET.format(name="DLA")})
    script = SCRIPT.format(imports="from models import *", build="DLA()")
    with recording_reads() as looked_at:
        analyse(cst.parse_module(script), str(tmp_path / "train.py"))
    assert str((tmp_path / "models" / "dla.py").resolve()) in looked_at


# -- what the rewrite does with them --------------------------------------------


def test_a_model_of_a_star_imported_class_is_sharded_after_its_device_move(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    result = _rewrite(tmp_path, SCRIPT.format(imports="from models import *", build="Generator(channels=3)"))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "fully_shard(block, mesh=mesh" in code  # the class's ModuleList was read from models.py
    # sharded after `generator = generator.cuda()` (the same module), before the optimizer
    assert code.index("generator = generator.cuda()") < code.index("fully_shard(generator, mesh=mesh)") \
        < code.index("optimizer = torch.optim.Adam")


def test_an_ambiguous_class_is_refused_naming_both_star_imports(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator"), "datasets.py": NET.format(name="Generator")})
    result = _rewrite(tmp_path, SCRIPT.format(imports="from models import *\nfrom datasets import *",
                                              build="Generator(channels=3)"))
    assert [(r.code, r.line) for r in result.refusals] == [("FSR611", 6)]  # the classes are its only modules
    assert "`from models import *` (line 3)" in result.refusals[0].what
    assert "`from datasets import *` (line 4)" in result.refusals[0].what


DISCRIMINATOR = '''\
discriminator = Critic()
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
'''


def test_an_unrecognised_model_beside_a_recognised_one_is_refused(tmp_path):
    """Before: the critic was sharded and the generator left whole on every rank, its
    gradients never reduced (the ranks drift apart, silently)."""
    _write(tmp_path, {
        "models.py": NET.format(name="Generator") + NET.format(name="Critic").split("\n", 2)[2],
        "datasets.py": NET.format(name="Generator"),
    })
    script = SCRIPT.format(imports="from models import *\nfrom datasets import *", build="Generator(channels=3)")
    script = script.replace("loader = ", DISCRIMINATOR + "loader = ")
    result = _rewrite(tmp_path, script)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR625", 6)]
    assert "`generator` (trained by the optimizer at line 9)" in result.refusals[0].what
    assert "`from datasets import *` (line 4)" in result.refusals[0].what


def test_an_unrecognised_factory_beside_a_recognised_model_is_refused(tmp_path):
    script = SCRIPT.format(imports="from gans import make_generator\n" + NET.format(name="Critic"),
                           build="make_generator(3)").replace("loader = ", DISCRIMINATOR + "loader = ")
    result = _rewrite(tmp_path, script)
    line = script.splitlines().index("generator = make_generator(3)") + 1
    assert [(r.code, r.line) for r in result.refusals] == [("FSR625", line)]


def test_check_sees_the_classes_of_a_star_import(tmp_path):
    """FSD109 needs the class of `model` to know `model.blocks` is a ModuleList."""
    _write(tmp_path, {"models.py": NET.format(name="Net")})
    for imports in ("from models import *", "from models import Net"):
        script = f"from torch.distributed.fsdp import fully_shard\n{imports}\nmodel = Net()\nfully_shard(model.blocks)\n"
        path = tmp_path / "train.py"
        path.write_text(script)
        ctx = LintContext(cst.parse_module(script), str(path))
        from fsdp2_retrofit.check.rules.shard_container import ShardContainer

        found = list(ShardContainer().check(ctx))
        assert [f[1]["kind"] for f in found] == ["ModuleList"], imports


# -- the pytorch-gan shape around the build --------------------------------------

GAN_BUILD = '''\
import torch
from torch.utils.data import DataLoader, TensorDataset
from models import *

cuda = torch.cuda.is_available()
generator = Generator()
discriminator = Critic()
loss_fn = torch.nn.MSELoss()
if cuda:
    generator = generator.cuda()
    discriminator = discriminator.cuda()
    loss_fn.cuda()
{init}
optimizer_G = torch.optim.Adam(generator.parameters(), lr=1e-3)
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 4)), batch_size=4)
for x, y in loader:
    loss = loss_fn(generator(x), y) + discriminator(x).mean()
    optimizer_G.zero_grad()
    optimizer_D.zero_grad()
    loss.backward()
    optimizer_G.step()
    optimizer_D.step()
'''
MODELS = NET.format(name="Generator") + NET.format(name="Critic").split("\n", 2)[2]


def test_fully_shard_follows_an_if_that_moves_several_models(tmp_path):
    _write(tmp_path, {"models.py": MODELS})
    result = _rewrite(tmp_path, GAN_BUILD.format(init="generator.apply(init_fn)\ndiscriminator.apply(init_fn)"))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert code.index("    loss_fn.cuda()") < code.index("fully_shard(generator, mesh=mesh)")
    assert code.index("generator.apply(init_fn)") < code.index("fully_shard(generator, mesh=mesh)")
    assert not [a for a in result.attention if a.differs]


def test_an_init_in_the_else_of_a_resume_runs_before_fully_shard_and_the_load_after(tmp_path):
    _write(tmp_path, {"models.py": MODELS})
    init = ("if opt_epoch:\n    generator.load_state_dict(torch.load('g.pth'))\n"
            "else:\n    generator.apply(init_fn)\n")
    script = GAN_BUILD.format(init="opt_epoch = 0\n" + init)
    result = _rewrite(tmp_path, script)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert code.index("if not opt_epoch:") < code.index("    generator.apply(init_fn)") \
        < code.index("fully_shard(generator, mesh=mesh)") < code.index("if opt_epoch:") \
        < code.index("set_model_state_dict(generator")
    assert "else:\n    generator.apply" not in code
    assert not [a for a in result.attention if a.differs]


def test_dtype_casts_rebinding_the_name_stay_before_fully_shard(tmp_path):
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    for cast in ("generator = generator.half()", "generator = generator.to(torch.bfloat16)",
                 "generator = generator.to(device).float()"):
        script = SCRIPT.format(imports="from models import *\ndevice = 'cpu'", build="Generator()")
        script = script.replace("optimizer = ", cast + "\noptimizer = ")
        result = _rewrite(tmp_path, script)
        assert not result.refusals, (cast, result.refusals)
        code = result.code.decode()
        assert code.index(cast) < code.index("fully_shard(generator, mesh=mesh)"), cast
        assert code.count(cast) == 1


def test_a_function_reading_a_module_level_model_as_a_global_saves_it_with_dcp(tmp_path):
    """kuangliu's test(epoch) saves `{'net': net.state_dict()}` of the global `net`: it
    was left a torch.save of one rank's shards."""
    _write(tmp_path, {"models.py": NET.format(name="Generator")})
    script = SCRIPT.format(imports="from models import *", build="Generator()").replace(
        'torch.save(generator.state_dict(), "out.pt")\n',
        "def save(step):\n    state = {'net': generator.state_dict(), 'step': step}\n"
        "    torch.save(state, 'ckpt.pth')\n\n\nsave(1)\n")
    result = _rewrite(tmp_path, script)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "'net': get_model_state_dict(generator)" in code
    assert "dcp.save(state, checkpoint_id='ckpt.pth')" in code
