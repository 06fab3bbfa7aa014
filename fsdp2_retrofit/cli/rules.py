"""`fsdp2-retrofit rules`: the lint rule and refusal catalogues, or one code's documentation."""
from __future__ import annotations

from typing import Optional

import click

from fsdp2_retrofit.cli import EXIT_ERROR


RULES_HELP = """\
List the lint rules and the rewrite's refusals, or explain one.

\b
  fsdp2-retrofit rules           the catalogues: lint rules (code, name, fix,
                                 summary), then what `rewrite` refuses (code,
                                 stage, name, summary)
  fsdp2-retrofit rules FSD101    why it matters, an example, the fix, and the
                                 flagged / not flagged cases the tests run
  fsdp2-retrofit rules FSR101    what is refused, why, and what to do
"""


@click.command("rules", help=RULES_HELP, short_help="The lint rules and refusal codes; one code's documentation.")
@click.argument("code", required=False, metavar="[CODE]")
@click.pass_context
def rules_command(ctx: click.Context, code: Optional[str]) -> None:
    from fsdp2_retrofit.check.rules import all_rules, rule_by_code
    from fsdp2_retrofit.rewrite.refusals import all_refusals, refusal_by_code

    if code is None:
        rules = all_rules()
        width = max(len(r.NAME) for r in rules)
        fix_width = max(len(r.fix_label()) for r in rules)
        for r in rules:
            click.echo(f"{r.CODE}  {r.NAME:<{width}}  {r.fix_label():<{fix_width}}  {r.summary()}")
        click.echo(
            "\nFixes: safe ones are applied by --fix; unsafe ones only with --unsafe-fixes too (they may change "
            "behaviour); *: some cases only. `fsdp2-retrofit rules CODE` explains one."
        )
        refusals = all_refusals()
        width = max(len(r.name) for r in refusals)
        stage_width = max(len(r.stage) for r in refusals)
        click.echo("\nrewrite refuses (the file is left unchanged, exit 2):")
        for r in refusals:
            click.echo(f"{r.code}  {r.stage:<{stage_width}}  {r.name:<{width}}  {r.summary}")
        return
    refusal = refusal_by_code(code)
    if refusal is not None:
        click.echo(refusal.doc(), nl=False)
        return
    rule = rule_by_code(code)
    if rule is None:
        click.echo(f"error: no rule {code!r} (see `fsdp2-retrofit rules`)", err=True)
        ctx.exit(EXIT_ERROR)
    click.echo(_rule_doc(rule))


def _rule_doc(rule) -> str:
    import inspect
    import textwrap

    doc = inspect.cleandoc(rule.__doc__ or "")
    lines = [f"# {rule.CODE} {rule.NAME}", "", f"Message: {rule.MESSAGE}", "", doc, "", "## Flagged"]
    for case in rule.INVALID:
        lines.append(f"(line {case.line})")
        lines.append(textwrap.indent(case.code.rstrip(), "    "))
        if case.fixed is not None:
            lines.append("fixed to:")
            lines.append(textwrap.indent(case.fixed.rstrip(), "    "))
        lines.append("")
    lines.append("## Not flagged")
    for case in rule.VALID:
        lines.append(textwrap.indent(case.code.rstrip(), "    "))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
