"""fsdp2-retrofit's rewrite stages, one concern a file, each a libcst codemod command.

Run one alone:  python -m libcst.tool codemod --no-format shard.ShardModelCommand train.py
Run them all:   python -m libcst.tool codemod --no-format retrofit.RetrofitCommand train.py
"""
