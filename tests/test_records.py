"""`@record` behaves as the dataclass declaration it replaces on check's start-up path."""
from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError, dataclass, field
from typing import List, Optional

import pytest

from fsdp2_retrofit.records import as_dict, record, replace


def _pair(frozen=False):
    """The same declaration as a dataclass and as a record."""

    def declare(decorator):
        @decorator
        class Site:
            name: str
            line: int = 0
            tags: List[str] = field(default_factory=list)
            node: Optional[object] = field(default=None, repr=False, compare=False)

        return Site

    return declare(dataclass(frozen=frozen)), declare(record(frozen=frozen))


@pytest.mark.parametrize("frozen", [False, True])
def test_construction_repr_and_equality_match_a_dataclass(frozen):
    Plain, Rec = _pair(frozen)
    for args, kwargs in [(("a",), {}), (("a", 3), {}), (("a",), {"tags": ["x"], "node": 1}), ((), {"name": "b", "line": 2})]:
        plain, rec = Plain(*args, **kwargs), Rec(*args, **kwargs)
        assert repr(rec) == repr(plain)
        assert as_dict(rec) == {k: getattr(plain, k) for k in ("name", "line", "tags", "node")}
    assert Rec("a", node=1) == Rec("a", node=2)  # compare=False field
    assert Rec("a") != Rec("a", 1)
    assert Rec("a").tags is not Rec("a").tags  # a fresh default per instance
    assert Rec("a") != Plain("a")  # another class is never equal


@pytest.mark.parametrize("args, kwargs, message", [
    ((), {}, "missing required argument: 'name'"),
    (("a", 1, [], None, 5), {}, "takes 4 positional arguments but 5 were given"),
    (("a",), {"name": "b"}, "multiple values for argument 'name'"),
    (("a",), {"colour": 1}, "unexpected keyword argument 'colour'"),
])
def test_bad_arguments_raise_type_error(args, kwargs, message):
    _, Rec = _pair()
    with pytest.raises(TypeError, match=message):
        Rec(*args, **kwargs)


def test_mutable_records_are_unhashable_and_frozen_ones_hash_by_value():
    _, Mutable = _pair()
    with pytest.raises(TypeError):
        hash(Mutable("a"))
    m = Mutable("a")
    m.line = 4
    assert m.line == 4
    _, Frozen = _pair(frozen=True)
    f = Frozen("a", 1, ())
    assert hash(f) == hash(Frozen("a", 1, ())) and len({f, Frozen("a", 1, ())}) == 1
    with pytest.raises(FrozenInstanceError):
        f.line = 2
    with pytest.raises(FrozenInstanceError):
        del f.name


def test_replace_post_init_and_pickle():
    calls = []

    @record(frozen=True)
    class Options:
        shard: tuple = ()
        level: int = 1

        def __post_init__(self):
            calls.append(self.level)
            if self.level < 0:
                raise ValueError("level")

    o = replace(Options(), level=3)
    assert (o.shard, o.level) == ((), 3) and calls == [1, 3]
    with pytest.raises(ValueError):
        Options(level=-1)
    r = _Picklable("a", 2, ["t"])
    assert pickle.loads(pickle.dumps(r)) == r  # what check's worker processes send back


@record
class _Picklable:  # pickle finds a class by its module-level name
    name: str
    line: int = 0
    tags: List[str] = field(default_factory=list)


def test_a_subclass_keeps_the_fields_of_its_base_first():
    @record
    class Base:
        name: str
        line: int = 0

    @record
    class Child(Base):
        tags: List[str] = field(default_factory=list)

    child = Child("a", 3)
    assert (child.name, child.line, child.tags) == ("a", 3, [])
    assert repr(child) == "test_a_subclass_keeps_the_fields_of_its_base_first.<locals>.Child(name='a', line=3, tags=[])"
    assert Child("a", 3) != Base("a", 3)
