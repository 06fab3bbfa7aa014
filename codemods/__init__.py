"""fsdp2-retrofit's rewrite stages, one concern a file, each usable as a libcst codemod command.

Run one alone:  python -m libcst.tool codemod --no-format shard.ShardModelCommand train.py
Run them all:   python -m libcst.tool codemod --no-format retrofit.RetrofitCommand train.py
"""
import sys

if "libcst.codemod" in sys.modules:
    # Loaded by libcst.tool (or a test): stages are CodemodCommands to it (`libcst.tool
    # list` names them). They do not subclass it, as importing libcst.codemod loads
    # libcst.matchers, most of the tool's start-up time; they have what its
    # `codemod` command uses (fsdp2_retrofit.rewrite.stage).
    from libcst.codemod import CodemodCommand

    from fsdp2_retrofit.rewrite.stage import RetrofitStage

    CodemodCommand.register(RetrofitStage)
