"""Kernel dispatch: one table per op, naming its implementations in order of preference, each with
a capability check that says why it cannot take a call.

    table = OpTable("kda", (Impl("pallas", cannot=..., auto_skips=...), Impl("chunked"), ...),
                    aliases={"xla": "chunked"}, explicit_only=("recurrent",))
    table.resolve("auto", K=48, V=48, dtype="float32")   # -> "chunked", logged once with why
    table.resolve("pallas", K=48, V=48)                  # raises UnsupportedImpl: why, how to fix
    table.problem("pallas", K=48, V=48)                  # the same message, or None (config checks)

Facts: keyword arguments describing the call (head dims, dtype, ...) and `platform` (default: the
running JAX platform, `pallas_kernels.backend.platform()`). A capability check reads only the
facts it needs and treats a missing fact as unknown (not a reason), so a model config, which knows
head dims and the dtype but not the batch or the sequence, can ask the same table up front.

Two kinds of reasons:
  cannot      the implementation cannot compute this call at all (shape, dtype): an explicit
              choice raises, "auto" skips it and logs a WARNING (a fallback the user may not
              expect, e.g. a head dim the Pallas KDA kernels cannot tile);
  auto_skips  it could run but "auto" does not pick it here (e.g. a CPU compiles no Pallas
              kernel, only interprets it, which is slow): an explicit choice still runs it,
              "auto" moves on and logs at DEBUG.
"auto" walks the implementations in order, skipping `explicit_only` ones, and takes the first
with no reason; every (op, choice, reasons) is logged once per process (logger
"pallas_kernels.dispatch"). Resolution happens in Python while a function is traced, so a jitted
call pays it once per compilation.

Not covered: choosing by measured speed (the order is fixed per table), per-call block sizes
(each kernel's config module picks those).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pallas_kernels import backend as _backend

log = logging.getLogger(__name__)

# A capability check: facts -> None when the implementation can take the call, else the reason.
Check = Callable[..., "str | None"]


class UnsupportedImpl(ValueError):
    """An explicitly requested implementation cannot take this call (or the name is unknown)."""


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    name        what `impl=` calls it (the op runs the code for this name);
    cannot      checks that must pass for the implementation to compute the call at all (each
                reason should say what would make the call acceptable);
    auto_skips  checks that only keep "auto" from picking it (the explicit name still runs).
    """

    name: str
    cannot: tuple[Check, ...] = ()
    auto_skips: tuple[Check, ...] = ()


def _reasons(checks: tuple[Check, ...], facts: Mapping[str, Any]) -> list[str]:
    return [r for r in (c(**facts) for c in checks) if r]


@dataclasses.dataclass(frozen=True)
class OpTable:
    """The implementations of one op, in auto's order of preference (see the module docstring).

    aliases       extra names for an implementation ({"xla": "chunked"});
    explicit_only implementations "auto" never picks (e.g. a slow oracle)."""

    op: str
    impls: tuple[Impl, ...]
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    explicit_only: tuple[str, ...] = ()

    def __post_init__(self):
        names = [i.name for i in self.impls]
        if len(set(names)) != len(names) or "auto" in names:
            raise ValueError(f"{self.op}: implementation names must be unique and not 'auto'")
        for a, target in self.aliases.items():
            if target not in names:
                raise ValueError(f"{self.op}: alias {a!r} points to unknown {target!r}")
        if not any(n not in self.explicit_only for n in names):
            raise ValueError(f"{self.op}: 'auto' needs at least one implementation to choose")

    # ------------------------------------------------------------------ names
    def names(self) -> tuple[str, ...]:
        """Every accepted `impl=` value: "auto", the aliases, the implementations."""
        return ("auto", *self.aliases, *(i.name for i in self.impls))

    def canonical(self, impl: str) -> str:
        """The implementation a name stands for ("auto" stays "auto"); unknown names raise."""
        if impl == "auto" or any(i.name == impl for i in self.impls):
            return impl
        if impl in self.aliases:
            return self.aliases[impl]
        raise UnsupportedImpl(f"{self.op}: impl must be one of {self.names()}, got {impl!r}")

    def _impl(self, name: str) -> Impl:
        return next(i for i in self.impls if i.name == name)

    # ------------------------------------------------------------------ capability
    def reasons(self, impl: str, **facts) -> list[str]:
        """Why implementation `impl` cannot compute a call with these facts ([] = it can)."""
        return _reasons(self._impl(self.canonical(impl)).cannot, _with_platform(facts))

    def problem(self, impl: str, **facts) -> str | None:
        """Why an explicit `impl` cannot take a call with these facts ("impl='pallas' cannot
        take this call: <reasons>"), or None when it can. "auto" can always run (its last
        resort has no shape limits). For config validation."""
        name = self.canonical(impl)
        if name == "auto":
            return None
        why = self.reasons(name, **facts)
        return f"impl={impl!r} cannot take this call: {'; '.join(why)}" if why else None

    def auto_order(self) -> list[str]:
        """The implementations "auto" tries, in order."""
        return [i.name for i in self.impls if i.name not in self.explicit_only]

    # ------------------------------------------------------------------ resolution
    def choose(self, impl: str, **facts) -> tuple[str, list[tuple[str, str, str]]]:
        """-> (implementation, skipped) without logging or raising for capability: skipped lists
        (implementation, "cannot" | "auto_skips", reason) for every implementation "auto"
        passed over. An explicit name comes back unchanged (see `resolve` for its check)."""
        name = self.canonical(impl)
        if name != "auto":
            return name, []
        facts = _with_platform(facts)
        skipped = []
        for i in self.impls:
            if i.name in self.explicit_only:
                continue
            hard = _reasons(i.cannot, facts)
            soft = _reasons(i.auto_skips, facts)
            if not hard and not soft:
                return i.name, skipped
            skipped += [(i.name, "cannot", r) for r in hard]
            skipped += [(i.name, "auto_skips", r) for r in soft]
        raise UnsupportedImpl(f"{self.op}: no implementation can take this call: "
                              + "; ".join(f"{n}: {r}" for n, _, r in skipped))

    def resolve(self, impl: str, **facts) -> str:
        """The implementation to run. "auto": the first in order that can take the call (logged
        once per (op, choice, reasons)); an explicit name: itself, or UnsupportedImpl saying
        why it cannot take the call and how to fix that."""
        name = self.canonical(impl)
        if name != "auto":
            why = self.problem(impl, **facts)
            if why:
                raise UnsupportedImpl(f"{self.op}: {why}; or use impl='auto' (runs the first of "
                                      f"{self.auto_order()} that can take the call)")
            return name
        chosen, skipped = self.choose("auto", **facts)
        _log_once(self.op, chosen, skipped, _with_platform(facts)["platform"])
        return chosen


def _with_platform(facts: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(facts)
    if out.get("platform") is None:
        out["platform"] = _backend.platform()
    return out


_LOGGED: set = set()


def _log_once(op: str, chosen: str, skipped: list, platform: str) -> None:
    key = (op, chosen, tuple(skipped))
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    why = "; ".join(f"{n} {'cannot' if kind == 'cannot' else 'not picked'}: {r}"
                    for n, kind, r in skipped)
    # WARNING: an implementation this platform would run was skipped for the call's shape/dtype;
    # otherwise DEBUG (on CPU every script would print one line per op that only says "XLA, the
    # CPU interprets Pallas": start-up noise)
    soft = {n for n, kind, _ in skipped if kind == "auto_skips"}
    hard = {n for n, kind, _ in skipped if kind == "cannot"}
    level = logging.WARNING if hard - soft else logging.DEBUG
    log.log(level, "%s: impl='auto' runs %r on %s%s", op, chosen, platform,
            f" ({why})" if why else "")


def reset_log() -> None:
    """Forget what was logged (tests)."""
    _LOGGED.clear()


# ---------------------------------------------------------------------- reusable checks
def pallas_compiles_here(*, platform=None, **_) -> str | None:
    """auto_skips check of every Pallas implementation: the platform must compile Pallas."""
    if _backend.accelerated(platform):
        return None
    return (f"platform {platform} compiles no Pallas kernel (interpret mode only, slow; "
            "impl='pallas' forces it)")


def dtypes(*allowed: str, fact: str = "dtype") -> Check:
    """A check: facts[fact] (a dtype or its name) must be one of `allowed`."""

    def check(**facts) -> str | None:
        d = facts.get(fact)
        if d is None:
            return None
        name = _dtype_name(d)
        return (None if name in allowed else
                f"{fact} {name} is not one of {allowed}: pass inputs in one of those")
    return check


def powers_of_two(*names: str, what: str = "") -> Check:
    """A check: every fact in `names` that is given must be a power of two."""

    def check(**facts) -> str | None:
        bad = [f"{n}={facts[n]}" for n in names
               if facts.get(n) is not None and not _pow2(int(facts[n]))]
        if not bad:
            return None
        return f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a power of two{what}"
    return check


def multiples_of(m: int, *names: str, what: str = "") -> Check:
    """A check: every fact in `names` that is given must be a multiple of m."""

    def check(**facts) -> str | None:
        bad = [f"{n}={facts[n]}" for n in names if facts.get(n) is not None and facts[n] % m]
        if not bad:
            return None
        return f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of {m}{what}"
    return check


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _dtype_name(d) -> str:
    import numpy as np  # noqa: PLC0415

    try:
        return np.dtype(d).name
    except TypeError:
        return str(d)
