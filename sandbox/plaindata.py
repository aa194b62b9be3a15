"""Plain data: the strict codec for values that cross from the process that ran a completion to
the process that judges it (sandbox/python_tests.py).

Covered types, each checked with an exact `type(x) is T` (a subclass is refused, whatever it
overrides): None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, nested
at most MAX_DEPTH deep with at most MAX_NODES values and MAX_CHARS characters/bytes in all.
Encoding never calls a method of a value it has not first checked to be one of those exact
builtin types, so an object with a custom `__eq__`, `__hash__`, `__bool__`, `__iter__`,
`__repr__` or `__reduce__` is refused, not consulted. Decoding accepts only the JSON the encoder
writes (anything else raises PlainDataError) and builds fresh builtin objects, so what comes out
can carry no behaviour.

JSON form: null, true, false, strings and arrays stand for None, bool, str and list; a JSON
integer is an int (written only for |x| < 2**53); a JSON number with a fraction or exponent is a
finite float; every other value is an object with exactly one key:
  {"int": "<hex>"}  {"float": "nan" | "inf" | "-inf"}  {"complex": [re, im]}
  {"bytes": "<hex>"}  {"tuple": [...]}  {"dict": [[k, v], ...]}  {"set": [...]}
  {"frozenset": [...]}  and, for return values only (below), {"counter": [[k, v], ...]}
  {"odict": [[k, v], ...]}  {"iter": [...]}
Set elements are sorted by the text of their encoded form, so equal sets encode equally
(`key_of` relies on it).

Between processes the encoded form travels as JSON: `dumps`/`loads`, or `to_json`, a small
writer that needs no import (the sandbox harnesses use it: importing `json` costs 8 ms of a
25 ms start). Into a sandbox, data goes as Python literals (`ascii()` of the encoded form).

A call is encoded as [[args...], [[name, value], ...]] with keyword arguments sorted by name.

Return values (`encode_result`, used only where the completion ran) are also accepted when an
exact conversion exists that `==` in the judging process sees the same way:
  - a subclass of a covered type whose classes (every one between it and the builtin) define no
    special method beyond INERT_DUNDERS (a namedtuple, a typing.NamedTuple, `class D(dict):
    pass`) becomes the builtin value (read through the builtin's own methods); a subclass that
    overrides `__eq__`, `__hash__`, `__iter__`, `__len__`, ... is still refused;
  - collections.Counter and collections.OrderedDict travel as {"counter": [[k, v], ...]} and
    {"odict": [[k, v], ...]} and are rebuilt as those stdlib classes (OrderedDict equality is
    order-sensitive, Counter's treats a missing key as 0); collections.defaultdict becomes a dict
    (its default factory cannot cross: a test reading a missing key fails, never passes wrongly);
  - an iterator of a builtin kind (a generator, map, filter, zip, enumerate, reversed, the
    iterators of list/tuple/str/range/set/dict) is drained (at most MAX_NODES values) and travels
    as {"iter": [...]}, rebuilt as an iterator over a list: `tuple(r)`, `list(r)`, `sorted(r)`
    and `next(r)` see the same values, `r == [..]` is False as it would be.
  The classes are recognised by identity (`type(x) is C`; collections' classes are looked up in
  sys.modules, never imported). Converted values lose their repr and extra attributes (`str()` of
  a namedtuple is a tuple's, `.x` does not exist): that can fail a test, never pass one wrongly.
  The process that ran the completion is untrusted anyway (it can forge its records, see
  sandbox/python_tests.py): what decides is that only plain JSON reaches the judge.

  - a range travels as {"range": [start, stop, step]}, a collections.deque as {"deque": [maxlen,
    [...]]} (its iterators as {"iter": ...}), dict views as {"keys": [...]}, {"values": [...]}
    and {"items": [[k, v], ...]}; each is rebuilt as the same type from its parts (a view over a
    new dict: keys and items compare as sets, values by identity, as the originals do).
Not covered: any other type (functions, user classes, numpy arrays, array.array); a dict
key or set element of an unhashable type cannot occur in a real dict or set anyway.

This file is also embedded verbatim into the programs that run inside the sandbox, so it uses
no import at all at module level and defines nothing beyond functions and constants.
"""

_INF = float("inf")

MAX_DEPTH = 300  # encode/decode take two frames a level; the judge compares recursively too
MAX_NODES = 1_000_000
MAX_CHARS = 64 << 20
_SAFE_INT = 1 << 53
_TAGS = ("int", "float", "complex", "bytes", "tuple", "dict", "set", "frozenset", "counter",
         "odict", "iter", "range", "deque", "keys", "values", "items")
# special methods a subclass may define and still be converted by encode_result: none of them
# changes how a built value compares, hashes, iterates, indexes, measures or converts
INERT_DUNDERS = frozenset({
    "__module__", "__qualname__", "__doc__", "__slots__", "__dict__", "__weakref__", "__new__",
    "__init__", "__repr__", "__getnewargs__", "__match_args__", "__annotations__",
    "__orig_bases__", "__firstlineno__", "__static_attributes__", "__type_params__"})
_BASES = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


def _builtin_iterator_types():
    def gen():
        yield
    samples = [gen(), map(len, ()), filter(None, ()), zip(), enumerate(()), reversed([]),
               iter([]), iter(()), iter(""), iter("\xe9"), iter(range(0)), iter(range(1 << 70)),
               iter(set()), iter({}), iter({}.values()), iter({}.items()), reversed(range(0))]
    return tuple({type(x): None for x in samples})


_ITER_TYPES = _builtin_iterator_types()
# dict views: keys and items compare as sets, values only by identity; rebuilt from a new dict
_VIEW_TYPES = ((type({}.keys()), "keys"), (type({}.values()), "values"),
               (type({}.items()), "items"))


class PlainDataError(ValueError):
    """A value (or a JSON text) that is not plain data in the sense of this module."""


def encode(value):
    """The JSON-able form of `value`; raises PlainDataError for anything not covered."""
    budget = [MAX_NODES, MAX_CHARS]
    try:
        return _enc(value, 0, budget)
    except RecursionError:
        raise PlainDataError("nested too deeply for this interpreter's stack") from None


def encode_result(value):
    """encode(), also converting what `encode` refuses when the conversion is exact (subclasses
    without behaviour, Counter, OrderedDict, defaultdict, builtin iterators: the module
    docstring). For return values in the process that ran the completion only: draining an
    iterator runs its code."""
    budget = [MAX_NODES, MAX_CHARS]
    try:
        return _enc(value, 0, budget, True)
    except RecursionError:
        raise PlainDataError("nested too deeply for this interpreter's stack") from None


def _enc(x, depth, budget, loose=False):
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH} (or cyclic)")
    budget[0] -= 1
    if budget[0] < 0:
        raise PlainDataError(f"more than {MAX_NODES} values")
    t = type(x)
    if x is None or t is bool:
        return x
    if t is int:
        if -_SAFE_INT < x < _SAFE_INT:
            return x
        budget[1] -= x.bit_length() // 4 + 1
        if budget[1] < 0:
            raise PlainDataError(f"more than {MAX_CHARS} characters")
        return {"int": int.__format__(x, "x")}
    if t is float:
        if x != x:
            return {"float": "nan"}
        if x == _INF or x == -_INF:
            return {"float": "inf" if x > 0 else "-inf"}
        return x
    if t is str:
        budget[1] -= len(x)
        if budget[1] < 0:
            raise PlainDataError(f"more than {MAX_CHARS} characters")
        return x
    if t is bytes:
        budget[1] -= 2 * len(x)
        if budget[1] < 0:
            raise PlainDataError(f"more than {MAX_CHARS} characters")
        return {"bytes": bytes.hex(x)}
    if t is complex:
        return {"complex": [_enc(x.real, depth + 1, budget), _enc(x.imag, depth + 1, budget)]}
    if t is list:
        return [_enc(v, depth + 1, budget, loose) for v in list.__iter__(x)]
    if t is tuple:
        return {"tuple": [_enc(v, depth + 1, budget, loose) for v in tuple.__iter__(x)]}
    if t is dict:
        return {"dict": _items(dict.items(x), depth, budget, loose)}
    if t is set or t is frozenset:
        items = [_enc(v, depth + 1, budget, loose) for v in t.__iter__(x)]
        items.sort(key=_text)
        return {t.__name__: items}
    if loose:
        return _enc_converted(x, t, depth, budget)
    raise PlainDataError(f"a value of type {_type_name(t)} is not plain data")


def _items(pairs, depth, budget, loose):
    return [[_enc(k, depth + 1, budget, loose), _enc(v, depth + 1, budget, loose)] for k, v in pairs]


def _enc_converted(x, t, depth, budget):
    """encode_result's conversions (module docstring); PlainDataError when none applies."""
    if t is range:  # its three ints rebuild it exactly (equality, len, indexing, iteration)
        return {"range": [_enc(v, depth + 1, budget) for v in (x.start, x.stop, x.step)]}
    for view, tag in _VIEW_TYPES:
        if t is view:
            items = list(x)
            if tag == "items":
                return {tag: [[_enc(k, depth + 1, budget, True), _enc(v, depth + 1, budget, True)]
                              for k, v in items]}
            return {tag: [_enc(v, depth + 1, budget, True) for v in items]}
    for it in _ITER_TYPES:
        if t is it:
            out = []
            for v in x:
                out.append(_enc(v, depth + 1, budget, True))
            return {"iter": out}
    coll = __import__("sys").modules.get("collections")
    if coll is not None:
        if t is getattr(coll, "deque", None):  # its items and maxlen rebuild it exactly
            return {"deque": [_enc(x.maxlen, depth + 1, budget),
                              [_enc(v, depth + 1, budget, True) for v in coll.deque.__iter__(x)]]}
        if t is type(iter(coll.deque())) or t is type(reversed(coll.deque())):
            return {"iter": [_enc(v, depth + 1, budget, True) for v in x]}
        known = [(getattr(coll, n, None), n) for n in ("Counter", "OrderedDict", "defaultdict")]
        for cls, name in known:
            if t is cls:
                pairs = dict.items(x) if name != "OrderedDict" else cls.items(x)
                tag = {"Counter": "counter", "OrderedDict": "odict"}.get(name, "dict")
                return {tag: _items(list(pairs), depth, budget, True)}
    base = _inert_subclass_of(t)
    if base is None:
        raise PlainDataError(f"a value of type {_type_name(t)} is not plain data (a subclass "
                             "that defines special methods, or an unknown type)")
    if base is dict:
        plain = dict(dict.items(x))
    elif base is complex:
        plain = complex(complex.__dict__["real"].__get__(x), complex.__dict__["imag"].__get__(x))
    elif base in (list, tuple, set, frozenset):
        plain = base(base.__iter__(x))
    else:  # int, float, str, bytes: the builtin's own constructor copies the value
        plain = base.__new__(base, x)
    return _enc(plain, depth, budget, True)


def _inert_subclass_of(t):
    """The covered builtin `t` derives from when every class between them defines only
    INERT_DUNDERS among its special methods and no class has a custom metaclass; else None."""
    if type(t) is not type:
        return None
    mro = type.__dict__["__mro__"].__get__(t)
    if len(mro) < 3 or mro[-1] is not object:
        return None
    base = mro[-2]
    if not any(base is b for b in _BASES):
        return None
    for c in mro[:-2]:
        if type(c) is not type:
            return None
        for k in type.__dict__["__dict__"].__get__(c):
            if type(k) is not str:
                return None
            if k[:2] == "__" and k[-2:] == "__" and k not in INERT_DUNDERS:
                return None
    return base


def _type_name(t):
    name = type.__dict__["__name__"].__get__(t)  # never a metaclass's own __name__
    return name if type(name) is str else "?"


def _text(enc):
    return ascii(enc)  # not repr: ascii() escapes the same way whatever the Unicode database


_JSON_ESC = {i: f"\\u{i:04x}" for i in range(32)}
_JSON_ESC.update({ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f",
                  13: "\\r"})


def _json_str(s):
    if s.isascii():
        return '"' + s.translate(_JSON_ESC) + '"'
    out = []
    for ch in s:
        o = ord(ch)
        if o < 128:
            out.append(ch.translate(_JSON_ESC))
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            o -= 0x10000
            out.append(f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}")
    return '"' + "".join(out) + '"'


def to_json(obj):
    """ASCII JSON text of a JSON-like value (dict with str keys, list, str, int, finite float,
    bool, None), as json.dumps would write it, without importing json."""
    t = type(obj)
    if t is str:
        return _json_str(obj)
    if obj is None:
        return "null"
    if t is bool:
        return "true" if obj else "false"
    if t is int:
        return int.__repr__(obj)
    if t is float:
        if obj != obj or obj == _INF or obj == -_INF:
            raise PlainDataError("a non-finite float has no JSON form")
        return float.__repr__(obj)
    if t is list:
        return "[" + ",".join([to_json(v) for v in obj]) + "]"
    if t is dict:
        if any(type(k) is not str for k in obj):
            raise PlainDataError("JSON object keys must be str")
        return "{" + ",".join([_json_str(k) + ":" + to_json(v) for k, v in obj.items()]) + "}"
    raise PlainDataError(f"{_type_name(t)} has no JSON form here")


def dumps(value):
    """encode() as compact JSON text (ASCII only)."""
    import json

    return json.dumps(encode(value), separators=(",", ":"))


def decode(enc):
    """The value for a JSON-able form made by `encode`; raises PlainDataError otherwise."""
    try:
        return _dec(enc, 0)
    except RecursionError:
        raise PlainDataError("nested too deeply for this interpreter's stack") from None


def _dec(e, depth):
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH}")
    t = type(e)
    if e is None or t is bool or t is str:
        return e
    if t is int:
        if not -_SAFE_INT < e < _SAFE_INT:
            raise PlainDataError("a plain JSON integer out of range (large ints use {\"int\": hex})")
        return e
    if t is float:
        if e != e or e == _INF or e == -_INF:
            raise PlainDataError("a non-finite JSON number (use {\"float\": ...})")
        return e
    if t is list:
        return [_dec(v, depth + 1) for v in e]
    if t is not dict or len(e) != 1:
        raise PlainDataError(f"unexpected JSON value of type {t.__name__}")
    (tag, p), = e.items()
    if tag == "int" and type(p) is str and 0 < len(p) <= MAX_CHARS:
        try:
            return int(p, 16)
        except ValueError:
            raise PlainDataError(f"bad hex int {p[:40]!r}") from None
    if tag == "float" and p in ("nan", "inf", "-inf"):
        return float(p)
    if tag == "bytes" and type(p) is str:
        try:
            return bytes.fromhex(p)
        except ValueError:
            raise PlainDataError("bad hex bytes") from None
    if type(p) is not list:
        raise PlainDataError(f"bad payload for tag {tag!r}")
    if tag == "complex" and len(p) == 2:
        re, im = _dec(p[0], depth + 1), _dec(p[1], depth + 1)
        if type(re) is not float or type(im) is not float:
            raise PlainDataError("complex parts must be floats")
        return complex(re, im)
    if tag == "tuple":
        return tuple(_dec(v, depth + 1) for v in p)
    if tag == "iter":
        return iter([_dec(v, depth + 1) for v in p])
    if tag in ("dict", "counter", "odict"):
        out = {}
        for kv in p:
            if type(kv) is not list or len(kv) != 2:
                raise PlainDataError("dict items must be [key, value] pairs")
            out[_hashable(_dec(kv[0], depth + 1))] = _dec(kv[1], depth + 1)
        if tag == "dict":
            return out
        coll = __import__("collections")
        return coll.Counter(out) if tag == "counter" else coll.OrderedDict(out)
    if tag in ("set", "frozenset"):
        items = [_hashable(_dec(v, depth + 1)) for v in p]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "range" and len(p) == 3:
        a, b, c = (_dec(v, depth + 1) for v in p)
        if not (type(a) is int and type(b) is int and type(c) is int and c != 0):
            raise PlainDataError("a range is three ints with a non-zero step")
        return range(a, b, c)
    if tag == "deque" and len(p) == 2 and type(p[1]) is list:
        maxlen = _dec(p[0], depth + 1)
        if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
            raise PlainDataError("a deque's maxlen is None or an int >= 0")
        return __import__("collections").deque([_dec(v, depth + 1) for v in p[1]], maxlen)
    if tag == "keys":
        return dict.fromkeys(_hashable(_dec(v, depth + 1)) for v in p).keys()
    if tag == "values":
        return dict(enumerate(_dec(v, depth + 1) for v in p)).values()
    if tag == "items":
        out = {}
        for kv in p:
            if type(kv) is not list or len(kv) != 2:
                raise PlainDataError("items must be [key, value] pairs")
            out[_hashable(_dec(kv[0], depth + 1))] = _dec(kv[1], depth + 1)
        return out.items()
    raise PlainDataError(f"unknown tag {tag!r} (known: {', '.join(_TAGS)})")


def _hashable(v):
    try:
        hash(v)
    except TypeError:
        raise PlainDataError(f"unhashable {type(v).__name__} as a dict key or set element") from None
    return v


def loads(text):
    """decode() of a JSON text (str); anything malformed raises PlainDataError."""
    if type(text) is not str or len(text) > 4 * MAX_CHARS:
        raise PlainDataError("plain data text must be a str of bounded size")
    import json

    try:
        enc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise PlainDataError(f"not JSON: {str(e)[:200]}") from None
    return decode(enc)


def _no_constant(name):
    raise PlainDataError(f"JSON constant {name} is not plain data")


def encode_call(args, kwargs):
    """[[encoded args], [[name, encoded value], ...]] with keyword names sorted."""
    if type(args) is not tuple or type(kwargs) is not dict:
        raise PlainDataError("arguments must be a tuple and a dict")
    budget = [MAX_NODES, MAX_CHARS]
    names = sorted(kwargs)
    return [[_enc(a, 1, budget) for a in args], [[n, _enc(kwargs[n], 1, budget)] for n in names]]


def decode_call(payload):
    """(args tuple, kwargs dict) from encode_call's form; PlainDataError if malformed."""
    if type(payload) is not list or len(payload) != 2 or type(payload[0]) is not list \
            or type(payload[1]) is not list:
        raise PlainDataError("a call must be [[args...], [[name, value], ...]]")
    args = tuple(_dec(a, 1) for a in payload[0])
    kwargs = {}
    for kv in payload[1]:
        if type(kv) is not list or len(kv) != 2 or type(kv[0]) is not str:
            raise PlainDataError("keyword arguments must be [name, value] pairs")
        kwargs[kv[0]] = _dec(kv[1], 1)
    return args, kwargs


def key_of(payload):
    """The canonical text of an encoded call: equal calls, equal keys, and the same text in the
    host and in the sandbox (ascii() does not depend on the interpreter's Unicode database)."""
    return _text(payload)
