"""Several models: frozen models (a distillation teacher), copies of a trained model
(EMA), and the refusals for copies the rewrite cannot shard. The execution proofs
are fixtures/rewrite/distill_frozen_teacher and fixtures/rewrite/ema_copy."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst
import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.analysis import analyse, code
from fsdp2_retrofit.analysis.copies import unsafe_state_copies
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

CLASSES = '''\
import copy

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


'''
LOOP = '''
    loader = DataLoader(list(range(8)), batch_size=2)
    for x in loader:
        loss = model(x).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''


def script(body: str, loop: str = LOOP) -> str:
    return CLASSES + "def main():\n" + dedent(body).replace("\n", "\n    ").rstrip() + "\n" + loop


def facts_of(source: str):
    return analyse(cst.parse_module(source), "train.py")


def stmt_code(node) -> str:
    return code(node).strip()


# -- frozen models --------------------------------------------------------------------


@pytest.mark.parametrize(
    "freeze",
    [
        "teacher.requires_grad_(False)",
        "teacher.eval()",
        "for p in teacher.parameters():\n    p.requires_grad = False",
        "for name, p in teacher.named_parameters():\n    p.requires_grad_(False)",
        "teacher = teacher  # (the build below chains .eval())",
    ],
    ids=["requires_grad_", "eval", "loop-assign", "loop-named-requires_grad_", "eval-in-build"],
)
def test_a_frozen_untrained_model_is_found(freeze):
    build = "teacher = Net().eval()" if "chains" in freeze else "teacher = Net()"
    freeze = "" if "chains" in freeze else freeze
    source = script(f"""
        {build}
        {freeze.replace(chr(10), chr(10) + '        ')}
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    facts = facts_of(source)
    assert [m.name for m in facts.models] == ["model"]
    assert [m.name for m in facts.frozen_models] == ["teacher"]
    names = next(iter(facts.model_names.values()))
    assert names >= {"model", "teacher"}
    assert next(iter(facts.trained_names.values())) == {"model"}


def test_untrained_unfrozen_modules_and_losses_are_not_frozen_models():
    facts = facts_of(script("""
        helper = Net()
        criterion = nn.CrossEntropyLoss()
        criterion.eval()
        model = Net()
        model.eval()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """))
    assert facts.frozen_models == []
    assert [m.name for m in facts.models] == ["model"]


def test_frozen_model_is_sharded_after_what_freezes_it_and_before_a_load():
    facts = facts_of(script("""
        teacher = Net()
        teacher.to("cpu")
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad = False
        teacher.load_state_dict(torch.load("teacher.pt"))
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """))
    (teacher,) = facts.frozen_models
    assert stmt_code(teacher.shard_anchor).startswith("for p in teacher.parameters():")


def test_frozen_model_shards_every_unit_after_forward():
    source = script("""
        teacher = Net()
        teacher.requires_grad_(False)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    out = rewrite_source(source.encode(), "train.py", RetrofitOptions()).code.decode()
    assert "for block in teacher.blocks:\n        fully_shard(block, mesh=mesh)\n" in out
    assert "fully_shard(teacher, mesh=mesh, reshard_after_forward=True)" in out
    assert out.index("fully_shard(teacher") < out.index("model = Net()")


def test_frozen_models_replicate_leaves_the_teacher_whole():
    source = script("""
        teacher = Net()
        teacher.requires_grad_(False)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(frozen_models="replicate"))
    assert "fully_shard(teacher" not in result.code.decode()
    assert any("stays replicated" in a.what for a in result.attention)


def test_cli_frozen_models_option(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(script("""
        teacher = Net()
        teacher.requires_grad_(False)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """))
    result = CliRunner().invoke(cli.main, ["rewrite", "--frozen-models", "replicate", "--quiet", str(path)])
    assert result.exit_code == 0, result.output
    assert "fully_shard(teacher" not in path.read_text()


# -- copies (EMA) ---------------------------------------------------------------------


def test_a_copy_right_after_the_build_is_sharded_like_the_model_after_it():
    facts = facts_of(script("""
        model = Net()
        ema = copy.deepcopy(model)
        model.to("cpu")
        for p in ema.parameters():
            p.requires_grad_(False)
        print(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """))
    (ema,) = facts.copies
    (model,) = facts.models
    assert ema.copy_of == "model" and [c.path for c in ema.containers] == [c.path for c in model.containers]
    # both are sharded after the later of the model's placement and the copy's freezing loop
    assert stmt_code(model.shard_anchor).startswith("for p in ema.parameters():")
    assert ema.shard_anchor is model.shard_anchor
    assert facts.frozen_models == []


def test_rewritten_copy_shards_model_then_copy_with_the_same_units():
    source = script("""
        model = Net()
        ema = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    out = rewrite_source(source.encode(), "train.py", RetrofitOptions()).code.decode()
    copy_at = out.index("ema = copy.deepcopy(model)")
    assert copy_at < out.index("fully_shard(model, mesh=mesh)") < out.index("for block in ema.blocks:")
    assert out.index("fully_shard(ema, mesh=mesh, reshard_after_forward=True)") < out.index("optimizer = ")
    again = rewrite_source(out.encode(), "train.py", RetrofitOptions())
    assert again.code.decode() == out and not again.refusals


@pytest.mark.parametrize(
    "body, loop, line_of",
    [
        (  # made inside the training loop
            """
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            LOOP + "        ema = copy.deepcopy(model)\n",
            "ema = copy.deepcopy(model)",
        ),
        (  # made under an `if`
            """
            model = Net()
            if torch.cuda.is_available():
                ema = copy.deepcopy(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            LOOP,
            "ema = copy.deepcopy(model)",
        ),
        (  # of a model that was rebound (compiled) in between
            """
            model = Net()
            model = torch.compile(model)
            ema = copy.deepcopy(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            LOOP,
            "ema = copy.deepcopy(model)",
        ),
        (  # an AveragedModel (copies inside its constructor) made under an `if`
            """
            model = Net()
            if torch.cuda.is_available():
                ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            LOOP,
            "ema = AveragedModel(",
        ),
    ],
    ids=["in-loop", "under-if", "after-rebinding", "AveragedModel-under-if"],
)
def test_cli_refuses_copies_it_cannot_shard(tmp_path, body, loop, line_of):
    source = script(body, loop)
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2, result.output
    line = next(i for i, text in enumerate(source.splitlines(), 1) if line_of in text)
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"{path}:{line}: "), first
    assert "copies a model that gets sharded" in first or "deep-copies a model that gets sharded" in first
    assert "hint:" in result.stderr
    assert path.read_text() == source


def test_cli_refuses_a_class_that_copies_the_model(tmp_path):
    source = CLASSES.replace(
        "class Net(nn.Module):",
        "class ModelEMA:\n    def __init__(self, model):\n        self.module = copy.deepcopy(model)\n\n\n"
        "class Net(nn.Module):",
    ) + "def main():\n    model = Net()\n    ema = ModelEMA(model)\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2, result.output
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "ema = ModelEMA(model)" in text)
    assert result.stderr.startswith(f"{path}:{line}: FSR608 class ModelEMA deep-copies the model it is handed")
    assert path.read_text() == source


def test_meta_init_with_a_copy_is_refused():
    source = script("""
        model = Net()
        ema = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(meta_init=True))
    assert [r.what for r in result.refusals] == ["--meta-init with a copy of the model"]


def test_a_copy_of_an_already_sharded_model_is_refused():
    source = script("""
        model = Net()
        fully_shard(model)
        ema = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """).replace("import copy\n", "import copy\nfrom torch.distributed.fsdp import fully_shard\n")
    facts = facts_of(source)
    assert facts.copies == [] and len(facts.deep_copies) == 1
    assert rewrite_source(source.encode(), "train.py", RetrofitOptions()).refusals


# -- EMA updates that do not survive sharding -----------------------------------------


def test_unsafe_state_copies_are_flagged_and_safe_ones_are_not():
    source = script("""
        model = Net()
        ema = copy.deepcopy(model)
        saved = torch.load("ema.pt")
        for k, v in ema.state_dict().items():
            v.copy_(saved[k])
        msd = model.state_dict()
        for k, v in ema.state_dict().items():
            v.copy_(msd[k])
        shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """, LOOP + """        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters()):
                p_ema.mul_(0.9).add_(p.detach(), alpha=0.1)
            ema.load_state_dict(model.state_dict())
""")
    found = [u.what for u in unsafe_state_copies(facts_of(source))]
    assert len(found) == 2, found
    assert found[0].startswith("`v.copy_(saved[k])` copies entries of `saved` into the state of sharded `ema`")
    assert "clones the state of sharded `model`" in found[1]
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals
    assert sum("sharded `" in a.what for a in result.attention) == 2


def test_two_models_each_with_its_optimizer_and_a_chained_copy_of_one():
    """A GAN with a generator EMA (`G_ema = copy.deepcopy(G).eval()`): each trained model
    is sharded before its own optimizer, the copy like its model, after the copy."""
    source = script("""
        G = Net()
        opt_g = torch.optim.Adam(G.parameters(), lr=0.1)
        G.to("cpu")
        G_ema = copy.deepcopy(G).eval()
        D = Net()
        opt_d = torch.optim.Adam(D.parameters(), lr=0.1)
    """, LOOP.replace("model(x)", "D(G(x))").replace("optimizer", "opt_d"))
    facts = facts_of(source)
    assert [(c.name, c.copy_of) for c in facts.copies] == [("G_ema", "G")]
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    out = result.code.decode()
    order = [
        "G_ema = copy.deepcopy(G).eval()",
        "fully_shard(G, mesh=mesh)",
        "opt_g = torch.optim.Adam",
        "fully_shard(G_ema, mesh=mesh, reshard_after_forward=True)",
        "D = Net()",
        "fully_shard(D, mesh=mesh)",
        "opt_d = torch.optim.Adam",
    ]
    assert [out.index(s) for s in order] == sorted(out.index(s) for s in order), out
    assert rewrite_source(out.encode(), "train.py", RetrofitOptions()).code.decode() == out


@pytest.mark.parametrize("handover", ["model = Net()\nmodel.encoder = encoder", "model = Wrapper(encoder)"])
def test_a_frozen_module_inside_a_trained_model_is_not_a_frozen_model(handover):
    source = script(f"""
        encoder = Net()
        encoder.requires_grad_(False)
        {handover.replace(chr(10), chr(10) + '        ')}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """).replace("class Net(nn.Module):", "class Wrapper(nn.Module):\n    def __init__(self, inner):\n"
                 "        super().__init__()\n        self.inner = inner\n\n\nclass Net(nn.Module):")
    facts = facts_of(source)
    assert [m.name for m in facts.models] == ["model"]
    assert facts.frozen_models == []


def test_a_frozen_model_built_under_an_if_stays_replicated():
    source = script("""
        teacher = None
        if torch.cuda.is_available():
            teacher = Net().eval()
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals
    assert "fully_shard(teacher" not in result.code.decode()
    assert any("stays replicated: it is built inside an `if`" in a.what for a in result.attention)


def test_an_averaged_model_right_after_the_build_has_its_module_sharded_like_the_model():
    source = script("""
        model = Net()
        swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """, LOOP + "    torch.save(swa.state_dict(), 'swa.pt')\n")
    facts = facts_of(source)
    assert [(c.name, c.copy_of) for c in facts.copies] == [("swa.module", "model")]
    assert "swa" in next(iter(facts.model_names.values()))
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    out = result.code.decode()
    assert "for block in swa.module.blocks:\n        fully_shard(block, mesh=mesh)\n" in out
    assert "fully_shard(swa.module, mesh=mesh, reshard_after_forward=True)" in out
    assert "dcp.save(get_model_state_dict(swa), checkpoint_id='swa.pt')" in out
    assert rewrite_source(out.encode(), "train.py", RetrofitOptions()).code.decode() == out


def test_a_teacher_load_comes_after_its_shard_and_is_converted_like_any_load():
    source = script("""
        teacher = Net()
        teacher.load_state_dict(torch.load("teacher.pt"))
        teacher.requires_grad_(False)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    out = result.code.decode()
    shard = out.index("fully_shard(teacher, mesh=mesh, reshard_after_forward=True)")
    load = out.index("set_model_state_dict(teacher, ")
    assert shard < load < out.index("teacher.requires_grad_(False)")
    assert "broadcast_from_rank0=True" in out[load:]
