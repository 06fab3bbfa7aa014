"""Gradient penalties (autograd.grad with create_graph, then backward): the model the penalty's graph
runs through is found by value and sharded with its units held gathered through backward, resharded
before its optimizer steps (fixtures gradient_penalty, gradient_penalty_solver, gradient_penalty_r1
train it at parity on 2 ranks); what that recipe cannot train is refused FSR624 at the line that
stops it, with that reason."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn

    G = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
    D = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)


    def penalty(critic, x):
        x = x.detach().requires_grad_(True)
        out = critic(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return (g.norm(dim=1) - 1).pow(2).mean()


    for step in range(3):
        real = torch.randn(8, 3)
        fake = G(torch.randn(8, 2))
        STEP
        opt_d.zero_grad()
        loss.backward()
        opt_d.step()
    """)


def _rewrite(step: str, script: str = SCRIPT):
    return rewrite_source(script.replace("STEP\n", dedent(step).replace("\n", "\n    ").rstrip(" ")).encode(),
                          "train.py")


def test_the_critic_holds_its_units_and_reshards_before_its_step():
    result = _rewrite("""\
        loss = D(fake.detach()).mean() - D(real).mean()
        loss = loss + 10 * penalty(D, real)
    """)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "fully_shard(D, mesh=mesh, reshard_after_forward=False)\nD.set_reshard_after_backward(False)" in code
    assert "fully_shard(G, mesh=mesh)\n" in code  # the generator is differentiated once: sharded as usual
    before_step = code[:code.index("    opt_d.step()")].rsplit("loss.backward()", 1)[1]
    assert "for unit in D.modules():" in before_step and "unit.reshard()" in before_step
    assert code.count(".reshard()") == 1  # before the critic's step only
    cost = next(c for c in result.changes if "keeps its gathered parameters" in c.what)
    assert "D` whole (41 parameters, 0.2 KiB in float32" in cost.why  # Linear(3, 8) + Linear(8, 1)


def test_a_forward_after_the_penalty_in_the_same_backward_is_refused_there():
    result = _rewrite("""\
        gp = penalty(D, real)
        loss = D(fake.detach()).mean() - D(real).mean() + 10 * gp
    """)
    (refusal,) = result.refusals
    assert refusal.code == "FSR624"
    assert refusal.line == 21  # the first forward after the penalty, not the autograd.grad call
    assert "after the gradient penalty (line 13), before the next backward() (line 23)" in refusal.what
    assert "arrives after the reduction" in refusal.why
    assert result.code == result.original


def test_the_penalty_taking_its_own_backward_first_converts():
    result = _rewrite("""\
        gp = penalty(D, real)
        gp.backward()
        loss = D(fake.detach()).mean() - D(real).mean()
    """)
    assert not result.refusals, result.refusals
    assert "D.set_reshard_after_backward(False)" in result.code.decode()


def test_a_penalty_through_two_models_holds_both():
    """inputs= is the generator's input: the second backward runs through G and D."""
    result = _rewrite("""\
        loss = D(fake.detach()).mean() - D(real).mean()
        z = torch.randn(8, 2, requires_grad=True)
        (g,) = torch.autograd.grad(D(G(z)).sum(), z, create_graph=True)
        loss = loss + g.pow(2).mean()
        opt_g.step()
    """)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "G.set_reshard_after_backward(False)" in code and "D.set_reshard_after_backward(False)" in code
    assert "for unit in G.modules():" in code and "for unit in D.modules():" in code


def test_a_held_model_whose_step_is_not_found_is_refused():
    """G is held for the penalty, but nothing steps its optimizer where G is in reach."""
    result = _rewrite("""\
        loss = D(fake.detach()).mean() - D(real).mean()
        z = torch.randn(8, 2, requires_grad=True)
        (g,) = torch.autograd.grad(D(G(z)).sum(), z, create_graph=True)
        loss = loss + g.pow(2).mean()
    """)
    (refusal,) = result.refusals
    assert refusal.code == "FSR624" and "through `G`, whose optimizer step the rewrite does not find" in refusal.what


def test_a_penalty_on_an_upstream_input_holds_only_the_model_between():
    """inputs= is what G produced: only D lies between inputs and outputs."""
    result = _rewrite("""\
        loss = D(fake.detach()).mean() - D(real).mean()
        x = G(torch.randn(8, 2))
        (g,) = torch.autograd.grad(D(x).sum(), x, create_graph=True)
        loss = loss + g.pow(2).mean()
    """)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "D.set_reshard_after_backward(False)" in code and "G.set_reshard_after_backward" not in code


def test_outputs_not_from_a_model_are_refused_with_that_reason():
    result = _rewrite("""\
        x = real.requires_grad_(True)
        (g,) = torch.autograd.grad(torch.tanh(x).sum(), x, create_graph=True)
        loss = D(fake.detach()).mean() - D(x).mean() + g.pow(2).mean()
    """)
    (refusal,) = result.refusals
    assert refusal.code == "FSR624" and refusal.line == 21
    assert "do not come from the forward of a model" in refusal.why


def test_a_model_sharded_without_the_recipe_is_refused():
    script = SCRIPT.replace(
        "opt_g = ", "from torch.distributed.fsdp import fully_shard\nfully_shard(D)\nfully_shard(G)\nopt_g = ")
    result = _rewrite("""\
        loss = D(fake.detach()).mean() - D(real).mean() + penalty(D, real)
    """, script)
    (refusal,) = result.refusals
    assert refusal.code == "FSR624" and "sharded already" in refusal.what


def test_outputs_unpacked_from_a_tuple_the_model_returns(tmp_path):
    """`scores, _ = D(x)` of a critic class in a sibling module with an auxiliary classifier head (as in
    StarGAN): the flow does not see into its forward; the element still comes from the critic's forward."""
    (tmp_path / "models.py").write_text(dedent("""\
        import torch.nn as nn


        class Critic(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(3, 8), nn.Tanh())
                self.adv, self.cls = nn.Linear(8, 1), nn.Linear(8, 2)

            def forward(self, x):
                h = self.body(x)
                return self.adv(h), self.cls(h)
        """))
    script = SCRIPT.replace("D = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))\n",
                            "from models import *\n\nD = Critic()\n").replace(
        "    out = critic(x)\n", "    out, _ = critic(x)\n")
    assert "out, _ = critic(x)" in script
    step = """\
        loss = D(fake.detach())[0].mean() - D(real)[0].mean()
        loss = loss + 10 * penalty(D, real)
    """
    path = tmp_path / "train.py"
    path.write_text(script.replace("STEP\n", dedent(step).replace("\n", "\n    ").rstrip(" ")))
    result = rewrite_source(path.read_bytes(), str(path))
    assert not result.refusals, result.refusals
    assert "D.set_reshard_after_backward(False)" in result.code.decode()


def test_a_scaler_step_gets_the_reshard_before_it():
    """`scaler.step(opt_d)` steps the critic's optimizer: the units are resharded before that call."""
    script = SCRIPT.replace("opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)\n",
                            "opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)\nscaler = torch.amp.GradScaler()\n")
    script = script.replace("    loss.backward()\n    opt_d.step()\n",
                            "    scaler.scale(loss).backward()\n    scaler.step(opt_d)\n    scaler.update()\n")
    result = _rewrite("""\
        loss = D(fake.detach()).mean() - D(real).mean() + penalty(D, real)
    """, script)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "unit.reshard()\n    scaler.step(opt_d)" in code
