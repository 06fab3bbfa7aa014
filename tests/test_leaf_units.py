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


RUNTIME_HEAD = "    head_unit = sum(p.numel() for p in model.head.parameters()) >= block_size\n"
RUNTIME_EMBEDDING = (
    "    if sum(p.numel() for p in model.tok_emb.parameters()) >= block_size:\n"
    "        fully_shard(model.tok_emb, mesh=mesh)\n"
)


def test_a_size_that_cannot_be_read_is_decided_at_run_time():
    """`int(input())`: the generated code counts one block before sharding and makes each large
    leaf a unit where it holds as many; the last block keeps its parameters unless the head unit is made."""
    out = _rewrite(SOURCE.replace("VOCAB = 512", "VOCAB = int(input())"))
    assert "    block_size = sum(p.numel() for p in model.blocks[0].parameters())" in out
    assert RUNTIME_HEAD in out and RUNTIME_EMBEDDING in out
    assert "reshard_after_forward=index < len(model.blocks) - 1 or head_unit)" in out
    assert "    if head_unit:\n    " + NORM_HEAD in out
    order = [out.index(s) for s in ("block_size = ", "fully_shard(block", RUNTIME_EMBEDDING, "if head_unit:",
                                    "fully_shard(model, mesh=mesh)")]
    assert order == sorted(order)


def test_a_run_time_size_under_reshard_never_needs_no_head_flag():
    out = _rewrite(SOURCE.replace("VOCAB = 512", "VOCAB = int(input())"), reshard_after_forward="never")
    assert "head_unit" not in out
    assert ("    if sum(p.numel() for p in model.head.parameters()) >= block_size:\n"
            "        fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=False)\n") in out


def test_a_leaf_smaller_than_what_a_block_holds_at_least_stays_in_the_root():
    """A block with a layer whose size is not read still holds its other layers: a leaf smaller than
    those is no unit, and no run-time comparison is written for it."""
    source = SOURCE.replace("        self.norm = nn.LayerNorm(dim)\n        self.fc",
                            "        self.norm = nn.LayerNorm(dim)\n        self.extra = nn.Linear(dim, int(input()))\n"
                            "        self.fc", 1)
    out = _rewrite(source.replace("VOCAB = 512", "VOCAB = 64"))  # 64 x 32 < the block's 8,416 read
    assert "block_size" not in out and _today(out)


def test_a_tied_leaf_of_a_run_time_size_stays_in_the_root():
    source = (FIXTURES / "leaf_units_tied" / "input.py").read_text()
    assert "VOCAB = 512" in source
    out = _rewrite(source.replace("VOCAB = 512", "VOCAB = int(input())"))
    assert "fully_shard(model.tok_emb" not in out and "fully_shard(model.head" not in out
    assert "block_size" not in out and LAST_BLOCK_KEEPS in out


ARGPARSE = (FIXTURES / "leaf_units_argparse" / "input.py").read_text()
ARG_EMBEDDING = "    fully_shard(model.tok_emb, mesh=mesh)\n"
ARG_HEAD = "    fully_shard([model.final_ln, model.lm_head], mesh=mesh, reshard_after_forward=False)\n"


def _changes(source: str) -> list:
    result = rewrite_source(source.encode(), "/tmp/leaf_units_train.py", RetrofitOptions())
    return [c.what for c in result.changes]


def test_argparse_defaults_size_the_leaves_and_the_report_names_them():
    out = _rewrite(ARGPARSE)
    assert ARG_EMBEDDING in out and ARG_HEAD in out and "block_size" not in out
    units = [c for c in _changes(ARGPARSE) if "as a unit of" in c]
    assert len(units) == 2 and all("sized from the defaults of --vocab-size (384), --dim (24)" in c for c in units)


def test_argparse_small_default_keeps_the_leaves_in_the_root():
    out = _rewrite(ARGPARSE.replace("default=384", "default=40"))  # 40 x 24 < one block (3,624)
    assert "fully_shard(model.tok_emb" not in out and "model.lm_head" not in out.split("fully_shard(model, mesh")[0]
    assert "block_size" not in out


def test_set_defaults_wins_over_the_options_default():
    source = ARGPARSE.replace("parser.set_defaults(n_layers=3)", "parser.set_defaults(n_layers=3, vocab_size=40)")
    assert "fully_shard(model.tok_emb" not in _rewrite(source)


def test_argparse_read_in_the_script_and_passed_as_sizes():
    """`TinyGPT(args.vocab_size, args.width)` in the script, `--vocab` spelled with a short option too."""
    source = ARGPARSE.replace("def __init__(self, args):", "def __init__(self, vocab_size, width, n_layers):")
    for name in ("vocab_size", "width", "n_layers"):
        source = source.replace(f"(args.{name}", f"({name}").replace(f", args.{name}", f", {name}")
    source = source.replace("TinyGPT(args)", "TinyGPT(args.vocab_size, args.width, args.n_layers)")
    source = source.replace('add_argument("--vocab-size"', 'add_argument("-v", "--vocab-size"')
    out = _rewrite(source)
    assert ARG_EMBEDDING in out and ARG_HEAD in out


def test_a_default_the_script_overrides_is_decided_at_run_time():
    """`args.vocab_size = ...` after parsing: the default is not what runs, so the comparison is the run's."""
    source = ARGPARSE.replace("    args = get_args()\n", "    args = get_args()\n    args.vocab_size = int(input())\n")
    out = _rewrite(source)
    assert "    if sum(p.numel() for p in model.tok_emb.parameters()) >= block_size:\n" in out
    assert all("--vocab-size" not in c for c in _changes(source))
    setattr_source = ARGPARSE.replace("    args = get_args()\n",
                                      '    args = get_args()\n    setattr(args, "vocab_size", int(input()))\n')
    assert "block_size" in _rewrite(setattr_source)
    printed = ARGPARSE.replace("    args = get_args()\n", "    args = get_args()\n    print(vars(args))\n")
    assert "block_size" not in _rewrite(printed)  # reading the namespace changes nothing


def test_a_required_option_is_decided_at_run_time():
    source = ARGPARSE.replace('"--vocab-size", type=int, default=384', '"--vocab-size", type=int, required=True')
    assert "block_size" in _rewrite(source)


def test_sub_commands_make_the_namespace_unread():
    source = ARGPARSE.replace("    parser.set_defaults(n_layers=3)\n",
                              "    parser.set_defaults(n_layers=3)\n    parser.add_subparsers(dest='cmd')\n")
    assert "block_size" in _rewrite(source)


def test_argparse_sizes_of_a_tied_model_stay_in_the_root():
    source = ARGPARSE.replace("        self.lm_head = nn.Linear(args.width, args.vocab_size, bias=False)\n",
                              "        self.lm_head = nn.Linear(args.width, args.vocab_size, bias=False)\n"
                              "        self.lm_head.weight = self.tok_emb.weight\n")
    out = _rewrite(source)
    assert "fully_shard(model.tok_emb" not in out and "model.lm_head" not in out.split("fully_shard(model, mesh")[0]


def test_config_objects_are_read():
    """A dict literal read by subscript, a SimpleNamespace read by attribute: static sizes, no comparison."""
    vocab = (FIXTURES / "leaf_units_runtime_vocab" / "input.py").read_text()
    literal = vocab.replace('{"n_vocab": len(vocab),', '{"n_vocab": 300,')
    out = _rewrite(literal)
    assert "block_size" not in out and "    fully_shard(net.embed, mesh=mesh)\n" in out
    small = _rewrite(vocab.replace('{"n_vocab": len(vocab),', '{"n_vocab": 20,'))
    assert "block_size" not in small and "fully_shard(net.embed" not in small
    assert 'config = {"n_vocab": 300, "d_model": opts.d_model, "n_layers": 2}' in literal
    spaced = literal.replace('config = {"n_vocab": 300, "d_model": opts.d_model, "n_layers": 2}',
                             "config = SimpleNamespace(n_vocab=300, d_model=16, n_layers=2)")
    spaced = spaced.replace('config["n_vocab"]', "config.n_vocab").replace('config["d_model"]', "config.d_model")
    spaced = spaced.replace('config["n_layers"]', "config.n_layers").replace("import argparse\n",
                                                                          "import argparse\nfrom types import SimpleNamespace\n")
    out = _rewrite(spaced)
    assert "block_size" not in out and "    fully_shard(net.embed, mesh=mesh)\n" in out


def test_a_vocabulary_built_from_data_is_decided_at_run_time():
    vocab = (FIXTURES / "leaf_units_runtime_vocab" / "input.py").read_text()
    out = _rewrite(vocab)
    assert "    if sum(p.numel() for p in net.embed.parameters()) >= block_size:\n" in out
    assert "    to_logits_unit = sum(p.numel() for p in net.to_logits.parameters()) >= block_size\n" in out
    # the width's default is read, but the comparison is the run's: the report names no default
    assert all("--d-model" not in c for c in _changes(vocab))


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
