"""The strict plain-data codec (sandbox/plaindata.py): exact builtin types round-trip; look-alikes
are refused without any of their methods being called; malformed JSON is refused."""

import json
import math

import pytest

from sandbox import plaindata as pd


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 2**53 - 1, 2**53, -(2**200), 2**20000, 0.0, -0.0, 1.5, 1e300, 5e-324,
    float("inf"), float("-inf"), 1 + 2j, "", "héllo\n\x00", "\ud800", b"", b"\xff\x00",
    [], [1, [2, [3]]], (), (1, "a", (None,)), {}, {"a": 1, 2: [3], (1, 2): {"x": None}},
    {1, 2, 3}, frozenset({"a", (1, 2)}), [{1: (frozenset(),)}],
], ids=lambda v: type(v).__name__)
def test_round_trip_keeps_exact_types(value):
    back = pd.loads(pd.dumps(value))
    assert back == value and type(back) is type(value)
    if isinstance(value, float) and value == 0:
        assert math.copysign(1, back) == math.copysign(1, value)
    assert pd.decode(json.loads(json.dumps(pd.encode(value)))) == value


def test_nan_and_container_identity():
    back = pd.loads(pd.dumps([float("nan")]))
    assert math.isnan(back[0])
    v = [1, 2]
    assert pd.decode(pd.encode(v)) is not v  # fresh objects


class Spy:
    """Records any method the codec might call on it."""
    calls: list = []

    def __eq__(self, other):
        Spy.calls.append("eq")
        return True

    def __hash__(self):
        Spy.calls.append("hash")
        return 0

    def __bool__(self):
        Spy.calls.append("bool")
        return True

    def __iter__(self):
        Spy.calls.append("iter")
        return iter(())

    def __repr__(self):
        Spy.calls.append("repr")
        return "1"

    def __index__(self):
        Spy.calls.append("index")
        return 1


class Meta(type):
    @property
    def __name__(cls):
        Spy.calls.append("meta-name")
        return "int"


class IntLike(int, metaclass=Meta):
    def __eq__(self, other):
        Spy.calls.append("int-eq")
        return True

    __hash__ = int.__hash__


class StrLike(str):
    def __eq__(self, other):
        Spy.calls.append("str-eq")
        return True

    __hash__ = str.__hash__


class ListLike(list):
    def __iter__(self):
        Spy.calls.append("list-iter")
        return iter([1])


class DictLike(dict):
    def items(self):
        Spy.calls.append("dict-items")
        return []


@pytest.mark.parametrize("make", [
    lambda: Spy(), lambda: IntLike(3), lambda: StrLike("a"), lambda: ListLike([1]),
    lambda: DictLike(a=1), lambda: [1, Spy()], lambda: {"k": StrLike("v")}, lambda: {Spy(): 1},
    lambda: (IntLike(1),), lambda: {Spy()}, lambda: range(3), lambda: (x for x in ()),
    lambda: bytearray(b"x"), lambda: print, lambda: type, lambda: object(),
])
def test_look_alikes_are_refused_without_calling_them(make):
    value = make()
    Spy.calls.clear()
    with pytest.raises(pd.PlainDataError):
        pd.encode(value)
    assert Spy.calls == [], Spy.calls  # (building {Spy(): 1} above hashed before the clear)


def test_depth_size_and_cycles_are_bounded():
    deep = []
    for _ in range(pd.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(pd.PlainDataError, match="deeper"):
        pd.encode(deep)
    cyc = []
    cyc.append(cyc)
    with pytest.raises(pd.PlainDataError):
        pd.encode(cyc)
    with pytest.raises(pd.PlainDataError, match="characters"):
        pd.encode(["x" * (pd.MAX_CHARS // 2 + 1)] * 2)


@pytest.mark.parametrize("text", [
    "NaN", "[Infinity]", '{"a": 1}', '{"int": 5}', '{"int": "zz"}', '{"float": "1.0"}',
    '{"bytes": "xyz"}', '{"tuple": 1}', '{"dict": [[1]]}', '{"dict": [[[1], 2]]}',
    '{"set": [[1]]}', '{"complex": [1, 2]}', '{"int": "1", "float": "nan"}', "9007199254740993",
    "[" * 100000 + "]" * 100000, "1e999", '"unterminated', "",
])
def test_malformed_json_is_refused(text):
    with pytest.raises(pd.PlainDataError):
        pd.loads(text)


def test_call_encoding_and_keys_are_canonical():
    a = pd.encode_call((1, {3, 1, 2}), {"b": 2, "a": [1]})
    b = pd.encode_call((1, {2, 3, 1}), {"a": [1], "b": 2})
    assert pd.key_of(a) == pd.key_of(b)
    assert pd.decode_call(a) == ((1, {1, 2, 3}), {"a": [1], "b": 2})
    assert pd.key_of(pd.encode_call((1,), {})) != pd.key_of(pd.encode_call((1.0,), {}))
    assert pd.key_of(pd.encode_call((True,), {})) != pd.key_of(pd.encode_call((1,), {}))
    for bad in ([1], [[1], {}], "x", [[], [[1, 2]]]):
        with pytest.raises(pd.PlainDataError):
            pd.decode_call(bad)


def test_to_json_writes_what_json_dumps_writes():
    import random

    rng = random.Random(0)
    texts = ["", "a\"b\\c\n\x00\x1f\t\r\b\f", "héllo", "\ud800", "\U0001f600"] + [
        "".join(chr(rng.randrange(0x110000)) for _ in range(40)) for _ in range(100)]
    values = texts + [0, -5, 2**52, 1.5, -0.0, 1e16, 5e-324, True, None,
                      [1, [2, {"k": "v"}]], {"a": [], "b\n": {}}, pd.encode({(1,): {2.5}})]
    for v in values:
        assert pd.to_json(v) == json.dumps(v, separators=(",", ":")), v
    for bad in (float("nan"), (1,), {1: 2}, b"x"):
        with pytest.raises(pd.PlainDataError):
            pd.to_json(bad)


def test_encode_result_converts_exactly_and_only_what_is_exact():
    import collections
    import typing

    class P(typing.NamedTuple):
        x: int
        y: int

    c = collections.Counter("abca")
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    od.move_to_end("b")  # the linked order, not the dict's storage order, is the value
    back = pd.decode(pd.encode_result(c))
    assert type(back) is collections.Counter and back == c
    back = pd.decode(pd.encode_result(od))
    assert type(back) is collections.OrderedDict and list(back.items()) == [("a", 2), ("b", 1)]
    assert pd.decode(pd.encode_result(P(1, 2))) == (1, 2) and type(pd.decode(pd.encode_result(P(1, 2)))) is tuple
    it = pd.decode(pd.encode_result(x * x for x in range(3)))
    assert tuple(it) == (0, 1, 4) and tuple(it) == ()  # an iterator, exhausted like the original
    assert pd.decode(pd.encode_result(collections.defaultdict(int, a=1))) == {"a": 1}
    assert pd.decode(pd.encode_result([{"k": map(str, [1])}])) != [{"k": ["1"]}]  # not a list

    class EqDict(dict):
        def __eq__(self, other):
            return True
        __hash__ = None

    class Quiet(collections.Counter):
        def __eq__(self, other):
            return True

    for bad in (EqDict(a=1), Quiet("a"), bytearray(b"a"), memoryview(b"a")):
        with pytest.raises(pd.PlainDataError):
            pd.encode_result(bad)
    for strict_refused in (c, od, P(1, 2), (x for x in ()), collections.defaultdict(int)):
        with pytest.raises(pd.PlainDataError):
            pd.encode(strict_refused)  # arguments and everything but results stay strict
