"""Leaf units (issue 33 item 1): large modules outside the repeated blocks (an embedding,
`[final norm, head]`) become FSDP units of their own when their parameter count, read from
the class definitions, is at least one block's; otherwise, and wherever a size cannot be
read or the leaf is tied or read outside its forward, the layout is today's (blocks, root).

The fixtures leaf_units_gpt and leaf_units_tied run at parity (tests/test_execution.py);
these vary one thing each on the same model.
"""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from rewrite_cases import FIXTURES

SOURCE = (FIXTURES / "leaf_units_gpt" / "input.py").read_text()
EMBEDDING = "    fully_shard(model.tok_emb, mesh=mesh)\n"
NORM_HEAD = "    fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=False)\n"
LAST_BLOCK_KEEPS = "reshard_after_forward=index < len(model.blocks) - 1)"


def _rewrite(source: str, **options) -> str:
    result = rewrite_source(source.encode(), str(Path("/tmp/leaf_units_train.py")), RetrofitOptions(**options))
    assert not result.refusals, result.refusals
    return result.code.decode()


def _today(out: str) -> bool:
    return EMBEDDING.strip() not in out and "model.head" not in out.split("fully_shard(model, mesh=mesh)")[0].split(
        "fully_shard(block")[-1] and LAST_BLOCK_KEEPS in out


def test_large_leaves_become_units_and_the_head_unit_keeps_its_parameters():
    out = _rewrite(SOURCE)
    assert EMBEDDING in out and NORM_HEAD in out
    assert LAST_BLOCK_KEEPS not in out  # the head runs last in forward now, not the last block
    order = [out.index(s) for s in ("fully_shard(block", EMBEDDING, NORM_HEAD, "fully_shard(model, mesh=mesh)")]
    assert order == sorted(order)


def test_small_leaves_stay_in_the_root():
    out = _rewrite(SOURCE.replace("VOCAB = 512", "VOCAB = 64"))  # 64 x 32 < one block (8,416)
    assert _today(out)


def test_a_size_that_cannot_be_read_keeps_todays_layout():
    out = _rewrite(SOURCE.replace("VOCAB = 512", "VOCAB = int(input())"))
    assert _today(out)


def test_a_renamed_size_gives_the_same_layout():
    renamed = SOURCE.replace("DIM", "WIDTH").replace("VOCAB", "N_TOKENS")
    assert _rewrite(renamed).count("fully_shard(") == _rewrite(SOURCE).count("fully_shard(")
    assert NORM_HEAD in _rewrite(renamed)


def test_a_norm_that_does_not_run_right_before_the_head_stays_in_the_root():
    """An input norm (before the blocks) is not the head's final norm: the head is a unit alone."""
    source = SOURCE.replace("        x = self.tok_emb(idx)\n", "        x = self.norm(self.tok_emb(idx))\n")
    source = source.replace("        x = self.norm(x)\n        return self.head(x)", "        return self.head(x)")
    out = _rewrite(source)
    assert "    fully_shard(model.head, mesh=mesh, reshard_after_forward=False)\n" in out
    assert "model.norm" not in out


def test_torch_2_4_shards_the_head_alone():
    """fully_shard takes a list of modules from torch 2.5 on: before, the norm stays in the root."""
    out = _rewrite(SOURCE, torch_version="2.4")
    assert "    fully_shard(model.head, mesh=mesh, reshard_after_forward=False)\n" in out
    assert "[model.norm" not in out


def test_a_tied_leaf_stays_in_the_root():
    out = _rewrite((FIXTURES / "leaf_units_tied" / "input.py").read_text())
    assert "fully_shard(model.tok_emb" not in out and "fully_shard(model.head" not in out
    assert LAST_BLOCK_KEEPS in out


def test_a_tie_made_by_the_script_keeps_both_in_the_root():
    source = SOURCE.replace("    optimizer = torch.optim", "    model.head.weight = model.tok_emb.weight\n    optimizer = torch.optim")
    assert _today(_rewrite(source))


def test_a_method_reading_a_leafs_parameter_keeps_it_in_the_root():
    source = SOURCE.replace("    def forward(self, idx):", "    def logits_scale(self):\n        return self.head.weight.norm()\n\n    def forward(self, idx):")
    out = _rewrite(source)
    assert EMBEDDING in out and "model.head" not in out.split("fully_shard(model, mesh=mesh)")[0]


def test_shard_option_names_the_units_itself():
    out = _rewrite(SOURCE, shard=("Block",))
    assert "fully_shard(model.tok_emb" not in out and "model.head" not in out


def test_reshard_never_and_always():
    never = _rewrite(SOURCE, reshard_after_forward="never")
    assert "    fully_shard(model.tok_emb, mesh=mesh, reshard_after_forward=False)\n" in never
    always = _rewrite(SOURCE, reshard_after_forward="always")
    assert EMBEDDING in always and "    fully_shard([model.norm, model.head], mesh=mesh)\n" in always


def test_the_benchmark_gpt_gets_the_expert_layout():
    """benchmarks/collectives.py compares the rewrite of its GPT with a hand-written torchtitan
    layout (benchmarks/expert_gpt.py): the rewrite gives the same units, at both sizes it runs."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from expert_gpt import WORKLOAD

    for dim, vocab in ((256, 4096), (1024, 32768)):
        sizes = f"DIM = {dim}\nVOCAB = {vocab}\nDEPTH = 6\nSEQ = 64\nBATCH = 8\nSTEPS = 3"
        out = _rewrite(WORKLOAD.replace("# SIZES", sizes))
        assert EMBEDDING in out and NORM_HEAD in out
        assert "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n" in out
