"""`@record`: a dataclass declaration without the dataclass start-up cost.

`@dataclasses.dataclass` compiles `__init__`, `__repr__` and `__eq__` from
generated source for every class when its module is imported: about 2.5 M
instructions a class (4 M frozen), measured with callgrind on CPython 3.11.
The ~30 classes on `check`'s path cost more than parsing the file it checks.
`@record` reads the same declaration (annotated fields, defaults,
`dataclasses.field(default=..., default_factory=..., repr=..., compare=...)`)
and gives the same behaviour (keyword or positional construction, repr,
field-wise ==, unhashable unless frozen, `frozen=True` refusing assignment)
with shared functions instead of generated ones. Use `replace()` here instead
of `dataclasses.replace`, `as_dict()` instead of `dataclasses.asdict`.
"""
from __future__ import annotations

from dataclasses import MISSING, Field, FrozenInstanceError
from typing import Any, Dict, Tuple


class _Spec:
    __slots__ = ("names", "defaults", "factories", "shown", "compared", "post_init")

    def __init__(self, cls: type) -> None:
        names = []
        defaults: Dict[str, Any] = {}
        factories: Dict[str, Any] = {}
        hidden = set()
        uncompared = set()
        for base in reversed(cls.__mro__):
            spec = base.__dict__.get("__record__")
            if spec is not None and base is not cls:
                for name in spec.names:
                    if name not in names:
                        names.append(name)
                defaults.update(spec.defaults)
                factories.update(spec.factories)
                hidden.update(n for n in spec.names if n not in spec.shown)
                uncompared.update(n for n in spec.names if n not in spec.compared)
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            if "ClassVar" in str(annotation):
                continue
            if name not in names:
                names.append(name)
            value = cls.__dict__.get(name, MISSING)
            if isinstance(value, Field):
                if value.default is not MISSING:
                    defaults[name] = value.default
                    setattr(cls, name, value.default)
                else:
                    delattr(cls, name)
                if value.default_factory is not MISSING:
                    factories[name] = value.default_factory
                if not value.repr:
                    hidden.add(name)
                if not value.compare:
                    uncompared.add(name)
            elif value is not MISSING:
                defaults[name] = value
        self.names: Tuple[str, ...] = tuple(names)
        self.defaults = defaults
        self.factories = factories
        self.shown = tuple(n for n in names if n not in hidden)
        self.compared = tuple(n for n in names if n not in uncompared)
        self.post_init = hasattr(cls, "__post_init__")


def _init(self, *args, **kwargs) -> None:
    spec: _Spec = type(self).__record__
    names = spec.names
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}() takes {len(names)} positional arguments but {len(args)} were given")
    values = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in values:
            raise TypeError(f"{type(self).__name__}() got multiple values for argument {key!r}")
        if key not in spec.names:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {key!r}")
        values[key] = value
    put = object.__setattr__
    for name in names:
        if name in values:
            value = values[name]
        elif name in spec.factories:
            value = spec.factories[name]()
        elif name in spec.defaults:
            value = spec.defaults[name]
        else:
            raise TypeError(f"{type(self).__name__}() missing required argument: {name!r}")
        put(self, name, value)
    if spec.post_init:
        self.__post_init__()


def _repr(self) -> str:
    spec: _Spec = type(self).__record__
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in spec.shown)
    return f"{type(self).__qualname__}({shown})"


def _key(self) -> tuple:
    return tuple(getattr(self, name) for name in type(self).__record__.compared)


def _eq(self, other):
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self) -> int:
    return hash(_key(self))


def _frozen_setattr(self, name, value):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self, name):
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def record(cls=None, /, *, frozen: bool = False):
    """Class decorator: `@record` or `@record(frozen=True)`, declared like a dataclass."""

    def wrap(cls):
        cls.__record__ = _Spec(cls)
        for name, function in (("__init__", _init), ("__repr__", _repr), ("__eq__", _eq)):
            if name not in cls.__dict__:
                setattr(cls, name, function)
        if frozen:
            cls.__setattr__ = _frozen_setattr
            cls.__delattr__ = _frozen_delattr
            cls.__hash__ = _hash
        elif "__hash__" not in cls.__dict__ or cls.__dict__["__hash__"] is None:
            cls.__hash__ = None  # mutable and compared by value, as a dataclass
        return cls

    return wrap if cls is None else wrap(cls)


def replace(obj, **changes):
    """A copy of the record `obj` with some fields changed (`dataclasses.replace`)."""
    values = {name: getattr(obj, name) for name in type(obj).__record__.names}
    values.update(changes)
    return type(obj)(**values)


def as_dict(obj) -> Dict[str, Any]:
    """The fields of the record `obj`, one level deep (enough for flat records)."""
    return {name: getattr(obj, name) for name in type(obj).__record__.names}
