"""The syntax layer: one table of torch's qualified names, one rank-0 classifier.

Rewrite stages and lint rules ask these the same questions, so they must agree; the
cases below are the spellings the older per-module copies accepted (and a few each
must reject)."""
import ast
from pathlib import Path

import libcst as cst
import pytest

from fsdp2_retrofit.syntax import rank, torch_api
from fsdp2_retrofit.report import RefusedError
from fsdp2_retrofit.syntax.names import Resolver

ROOT = Path(__file__).resolve().parents[1]


def expr(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


# -- the rank-0 classifier ----------------------------------------------------

@pytest.mark.parametrize(
    "test, side",
    [
        # true on rank 0 only: the if's body runs there
        ("rank == 0", "body"),
        ("0 == rank", "body"),
        ("rank is 0", "body"),
        ("args.local_rank == 0", "body"),
        ("dist.get_rank() == 0", "body"),
        ('int(os.environ["RANK"]) == 0', "body"),
        ('int(os.environ.get("RANK", 0)) == 0', "body"),
        ("args.local_rank in (-1, 0)", "body"),
        ("local_rank in [0]", "body"),
        ("not rank", "body"),
        ("not dist.get_rank()", "body"),
        ("master_process", "body"),
        ("args.is_master", "body"),
        ("accelerator.is_main_process", "body"),
        ("is_main_process()", "body"),
        ("is_main_process(args)", "body"),
        ("trainer.is_rank_zero", "body"),
        ("is_rank0()", "body"),
        ("state.is_primary", "body"),
        ("is_chief", "body"),
        ("step % N == 0 and rank == 0", "body"),
        ("master_process and step % 100 == 0", "body"),
        # false on rank 0 only: its else branch runs there
        ("rank != 0", "else"),
        ("rank > 0", "else"),
        ("0 < rank", "else"),
        ("not master_process", "else"),
        ("not is_main_process()", "else"),
        ("rank != 0 or verbose", "else"),
        # not a rank-0 gate
        ("rank == 1", None),
        ("rank >= 0", None),
        ("step % 2 == 0", None),
        ("args.rank_loss", None),
        ("args.rank_loss == 0", None),
        ("rank % 2 == 0", None),
        ("world_size == 0", None),
        ("local_rank in (1, 2)", None),
        ("rank == 0 or verbose", None),
        ("not verbose", None),
        ("verbose", None),
    ],
)
def test_which_branch_of_a_test_runs_on_rank_zero_only(test, side):
    assert rank.rank_zero_side(expr(test)) == side


@pytest.mark.parametrize(
    "test, gated",
    [
        ("rank == 0", True),
        ("args.local_rank in (-1, 0)", True),
        ("is_main_process()", True),
        ("not rank", True),
        # a conjunction is split by split_rank_test, not one rank test
        ("step % 10 == 0 and rank == 0", False),
        ("rank != 0", False),
        ("args.rank_loss", False),
    ],
)
def test_one_rank_test_is_one_condition_true_on_rank_zero(test, gated):
    assert rank.is_rank_test(expr(test)) is gated


@pytest.mark.parametrize(
    "test, mentions",
    [
        ("step % 10 == 0 and master_process", True),
        ("a or rank == 0", True),
        ("(x and dist.get_rank() == 0) or y", True),
        ("rank != 0", False),
        ("step % 10 == 0", False),
    ],
)
def test_a_rank_test_anywhere_in_a_condition(test, mentions):
    assert rank.mentions_rank_test(expr(test)) is mentions


def test_a_conjunction_splits_into_its_rank_tests_and_the_rest():
    ranks, other = rank.split_rank_test(expr("step % 10 == 0 and rank == 0 and verbose"))
    assert [cst.Module([]).code_for_node(p) for p in ranks] == ["rank == 0"]
    assert [cst.Module([]).code_for_node(p) for p in other] == ["step % 10 == 0", "verbose"]
    assert rank.split_rank_test(expr("not rank and verbose")) == ([], [])


@pytest.mark.parametrize(
    "text, mentions",
    [("seed + rank", True), ("seed + args.local_rank", True), ("MASTER", True), ("is_main and x", True),
     ("seed + 1", False), ("verbose", False)],
)
def test_a_text_that_thinks_about_ranks(text, mentions):
    assert rank.mentions_rank(expr(text)) is mentions


def _values(source: str):
    module = cst.parse_module(source)
    resolver = Resolver(module)
    return resolver, {
        s.body[0].targets[0].target.value: s.body[0].value
        for s in module.body
        if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Assign)
    }


def test_rank_and_world_size_values():
    resolver, values = _values(
        "import os\nimport torch.distributed as dist\nfrom torch.distributed import get_world_size\n"
        "a = dist.get_rank()\nb = int(os.environ['RANK'])\nc = int(os.getenv(\"RANK\", 0))\n"
        "d = get_world_size()\ne = int(os.environ['WORLD_SIZE'])\nf = int(os.environ['LOCAL_RANK'])\n"
        "g = get_rank()\nh = 0\n"
    )
    ranks = {k for k, v in values.items() if rank.is_rank_value(v, resolver)}
    sizes = {k for k, v in values.items() if rank.is_world_size_value(v, resolver)}
    assert ranks == {"a", "b", "c"}
    assert sizes == {"d", "e"}


def test_the_lint_prefilter_holds_every_rank_word():
    from fsdp2_retrofit.check.rules.rank_gated_collective import RankGatedCollective

    for word in (rank.RANK_WORD, *rank.MAIN_WORDS):
        assert word in RankGatedCollective.TRIGGERS and word.upper() in RankGatedCollective.TRIGGERS


# -- the table of torch names -------------------------------------------------

@pytest.mark.parametrize(
    "source, table",
    [
        ("from torch.nn.parallel import DistributedDataParallel as DDP\nDDP(m)", "DDP"),
        ("import torch.nn.parallel.distributed as d\nd.DistributedDataParallel(m)", "DDP"),
        ("import torch.nn as nn\nnn.DataParallel(m)", "DATA_PARALLEL"),
        ("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nFSDP(m)", "FSDP1_CLASSES"),
        ("from torch.distributed.fsdp import fully_shard\nfully_shard(m)", "FULLY_SHARD"),
        ("from torch.distributed._composable.fsdp import fully_shard\nfully_shard(m)", "FULLY_SHARD"),
        ("import torch.distributed as dist\ndist.init_process_group('gloo')", "INIT_PROCESS_GROUP"),
        ("from torch.distributed.distributed_c10d import init_process_group\ninit_process_group()",
         "INIT_PROCESS_GROUP"),
        ("import torch\ntorch.save(x, 'p')", "TORCH_SAVE"),
        ("from torch.serialization import load\nload('p')", "TORCH_LOAD"),
        ("import torch.distributed.checkpoint as dcp\ndcp.save(x)", "DCP_CALLS"),
        ("from torch.nn.modules.container import ModuleList\nModuleList([])", "CONTAINERS"),
        ("import torch.multiprocessing as mp\nmp.spawn(f)", "SPAWN"),
        ("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\nShardedGradScaler()",
         "SHARDED_GRAD_SCALER"),
        ("import torch\ntorch.nn.utils.clip_grad_norm_(p, 1.0)", "CLIP_GRAD_NORM"),
    ],
)
def test_each_spelling_resolves_into_its_table_entry(source, table):
    module = cst.parse_module(source)
    resolver = Resolver(module)
    call = module.body[-1].body[0].value
    assert resolver.is_call_to(call, getattr(torch_api, table))


def test_the_analyses_and_the_rules_share_the_table():
    """The names modules used to define for themselves are the table's objects now."""
    from fsdp2_retrofit.analysis import checkpoints, fsdp1, process_group, sharding, wrappers
    from fsdp2_retrofit.check.rules import fsdp1_api, missing_set_device, shard_container
    from fsdp2_retrofit.syntax import names

    assert checkpoints.SAVE is torch_api.TORCH_SAVE and checkpoints.LOAD is torch_api.TORCH_LOAD
    assert fsdp1.SCALER is fsdp1_api.SCALER is torch_api.SHARDED_GRAD_SCALER
    assert fsdp1.FSDP1_CLASSES is fsdp1_api.FSDP1_CLASSES is sharding.FSDP1 is torch_api.FSDP1_CLASSES
    assert missing_set_device.INIT is torch_api.INIT_PROCESS_GROUP
    assert process_group.SET_DEVICE <= missing_set_device.SET_DEVICE  # check accepts any device choice
    assert wrappers.DDP is torch_api.DDP and names.FULLY_SHARD is torch_api.FULLY_SHARD
    assert shard_container._BARE <= names.CONTAINERS


def _torch_name_sets(path: Path):
    """Module-level set literals (or frozenset(...) calls) holding "torch." strings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "frozenset":
            value = value.args[0] if value.args else value
        if isinstance(value, (ast.Set, ast.SetComp)) and any(
            isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("torch.")
            for c in ast.walk(value)
        ):
            yield node.lineno


def test_no_module_keeps_its_own_copy_of_torch_names():
    table = ROOT / "fsdp2_retrofit" / "syntax" / "torch_api.py"
    assert list(_torch_name_sets(table)), "the detector finds the table's own sets"
    copies = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("fsdp2_retrofit", "codemods")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != table
        for line in _torch_name_sets(path)
    ]
    assert copies == []


def test_walk_visits_every_node_but_whitespace_leaves_in_libcst_order():
    from fsdp2_retrofit.syntax.names import walk

    module = cst.parse_module("def f(a, *, b=1):\n    x = [i for i in a if i]\n    return f'{x!r:>{b}}'\n")
    seen = []

    class _All(cst.CSTVisitor):
        def on_visit(self, node) -> bool:
            seen.append(node)
            return True

    module.visit(_All())
    kept = [n for n in seen if type(n) is not cst.SimpleWhitespace]
    assert len(kept) < len(seen)  # the index leaves SimpleWhitespace out (their breaks count with the parent)
    assert [id(n) for n in walk(module)] == [id(n) for n in kept]
    inner = module.body[0].body  # not indexed by a Resolver: walked, the same nodes
    assert [id(n) for n in walk(inner)] == [id(n) for n in kept[kept.index(inner):kept.index(inner) + len(walk(inner))]]


def test_last_assignment_is_the_latest_binding_before_the_statement():
    from fsdp2_retrofit.syntax.names import last_assignment

    module = cst.parse_module("a = 1\nb = 2\na = 3\nprint(a)\na = 4\n")
    stmt = module.body[3]
    assert last_assignment("a", stmt, module) is module.body[2]
    assert last_assignment("b", stmt, module) is module.body[1]
    assert last_assignment("c", stmt, module) is None


_PARTS = [pytest.param(0, id="part0")] + [pytest.param(i, id=f"part{i}", marks=pytest.mark.integration) for i in (1, 2, 3)]


@pytest.mark.parametrize("part", _PARTS)  # a quarter of the files in the fast loop, all in the full run
def test_render_writes_what_libcst_writes(part):
    """syntax.names.render (libcst's code generation without its no-op position hooks) gives
    libcst's text for every golden (every eighth also as CRLF and tab-indented copies) and
    each of its top-level statements."""
    from fsdp2_retrofit.syntax.names import render

    files = sorted((ROOT / "fixtures" / "rewrite").rglob("expected.py"))
    assert len(files) > 50
    for i, path in list(enumerate(files))[part::4]:
        text = path.read_text()
        variants = [text] if i % 8 else [text, text.replace("\n", "\r\n"), text.replace("    ", "\t")]
        for variant in variants:
            try:
                module = cst.parse_module(variant)
            except cst.ParserSyntaxError:
                continue  # a tab-indented copy of a file that mixes indents
            assert render(module) == module.code, path
            for stmt in module.body:
                assert render(stmt, module) == module.code_for_node(stmt), path


def _rewritten_tree(source: bytes):
    """The pipeline's tree for `source` and its Origins (what rewrite_source renders)."""
    from codemods.retrofit import RetrofitCommand
    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.rewrite.context import RewriteContext
    from fsdp2_retrofit.rewrite.stage import OPTIONS_KEY, ORIGINS_KEY
    from fsdp2_retrofit.syntax.names import Origins

    module = cst.parse_module(source)
    context = RewriteContext(filename="train.py")
    context.scratch[OPTIONS_KEY] = RetrofitOptions()
    origins = context.scratch[ORIGINS_KEY] = Origins(module, source.decode(module.encoding))
    return RetrofitCommand(context, RetrofitOptions()).transform_module(module), origins


@pytest.mark.parametrize("part", _PARTS)
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_origins_render_writes_what_libcst_writes(newline, part):
    """Origins.render (the statements the rewrite kept copied from the user's text) gives
    libcst's text of the rewritten tree for every fixture input (also as CRLF), and for
    files whose lines are counted the hard way: a string holding a lone \\r, a backslash
    continuation, a form feed, a BOM, comments after the last statement, mixed newlines."""
    from fsdp2_retrofit.pipeline import rewrite_source

    example = (ROOT / "fixtures" / "examples" / "train_single.py").read_text()
    odd = [
        example.replace("import torch\n", "import torch\nX = '''a\rb'''  # lone CR\nY = 1 + \\\n    2\n\x0c\n", 1),
        "\ufeff" + example,
        example + "\n# the end\n\n",
        example.replace("import torch\n", "import torch\r\n", 1),
    ]
    files = sorted((ROOT / "fixtures" / "rewrite").rglob("input.py"))[part::4]
    texts = [p.read_text() for p in files] + (odd if part == 0 else [])
    kept = 0
    for text in texts:
        text = text.replace("\n", newline) if newline != "\n" else text
        try:
            tree, origins = _rewritten_tree(text.encode("utf-8"))
        except RefusedError:  # a refusal: nothing rendered
            continue
        kept += any(stmt in origins.first.body for stmt in tree.body)
        assert origins.render(tree) == tree.code, text[:80]
    assert kept > len(files) // 2  # the copying path is the one tested
    data = odd[0].replace("\n", newline).encode()
    assert rewrite_source(data, "train.py").code.decode() == _rewritten_tree(data)[0].code
