"""StatementEditor's expression edits: keyed by original node, composed in order."""
from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fsdp2_retrofit.rewrite.stage import CombinedEditor, StatementEditor


def _find(tree: cst.Module, matcher):
    return m.findall(tree, matcher)


def test_a_function_edit_receives_the_node_with_its_childrens_edits():
    tree = cst.parse_module("y = f(g(x))\n")
    outer, inner = _find(tree, m.Call(func=m.Name("f"))) + _find(tree, m.Call(func=m.Name("g")))
    editor = StatementEditor()
    assert not editor.has_work()
    editor.replace_expression(inner, cst.parse_expression("h(x)"))
    editor.replace_expression(outer, lambda call: call.with_changes(func=cst.Name("ff")))
    assert editor.has_work()
    assert tree.visit(editor).code == "y = ff(h(x))\n"


def test_edits_of_one_node_apply_in_order_and_a_node_replaces():
    tree = cst.parse_module("a = b\n")
    (name,) = _find(tree, m.Name("b"))
    editor = StatementEditor()
    editor.replace_expression(name, lambda n: n.with_changes(value=n.value + "1"))
    editor.replace_expression(name, lambda n: n.with_changes(value=n.value + "2"))
    assert tree.visit(editor).code == "a = b12\n"
    editor.replace_expression(name, cst.Name("c"))
    assert tree.visit(editor).code == "a = c\n"


def test_statement_edits_see_expression_edits_of_a_moved_statement():
    tree = cst.parse_module("x = f(1)\ny = 2\n")
    first, second = tree.body
    (call,) = _find(tree, m.Call())
    editor = StatementEditor()
    editor.replace_expression(call, lambda c: c.with_changes(func=cst.Name("g")))
    editor.move_after(first, second)
    assert tree.visit(editor).code == "y = 2\nx = g(1)\n"


def test_combined_editor_applies_each_stages_edits_in_stage_order():
    tree = cst.parse_module("run(a)\n")
    (call,) = _find(tree, m.Call())
    first, second = StatementEditor(), StatementEditor()
    first.replace_expression(call, lambda c: c.with_changes(args=[*c.args, cst.Arg(cst.Name("b"))]))
    second.replace_expression(call, lambda c: c.with_changes(func=cst.Name("go")))
    second.insert_before(tree.body[0], [cst.parse_statement("setup()\n")])
    combined = CombinedEditor([first, second])
    assert combined.has_work()
    assert tree.visit(combined).code == "setup()\ngo(a, b)\n"
