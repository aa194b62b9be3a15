"""The registry of layer kinds: one entry per letter of `ModelConfig.layer_pattern`.

    from model.layers import registry
    kind = registry.get("K")      # LayerKind(name="kda", section="kda", layer=KDALayer, ...)
    registry.register("C", LayerKind(...))   # a kind defined elsewhere; registry.unregister("C")

A `LayerKind` is everything the rest of the code needs to know about a kind:
  layer         the Linen module, following the `SequenceMixer` protocol below;
  config        the frozen dataclass of its ModelConfig section (the field or key `section`), with
                validate(model, section) raising model.config.ConfigError naming the bad field;
  cache_axes    logical mesh axes of each of its decode-cache leaves, by leaf name (leaves not
                listed split over the batch only);
  device_slice  (section, heads, kernels) -> the section one device computes under tensor
                parallelism (`heads(n)`: n divided over the mesh axes heads map to) with its
                kernels set as impl=`kernels` ("pallas" | "xla") would run them on GPU/TPU; the
                planner traces that slice (model/plan.py). None: nothing to split.

Readers: model/config.py (valid letters, sections, section validation), model/transformer.py
(blocks, caches, speculative commit), model/plan.py (device slices, decode-cache axes).
Adding a kind touches its layer file (module, config class, a `KIND = LayerKind(...)`) and one
line of `_BUILTIN`, or a `register` call from anywhere (tests/model/test_layer_registry.py).
The built-in entries are "module:attribute" strings imported on first use, so model/config.py
can read the registry without importing the layers (which import it) at import time. This
module imports nothing from model: model/config.py imports it and hands it the ModelConfig field
names no kind's section may take (`reserve_sections`); the layers' config classes raise
model.config_base's ConfigError (re-exported by model.config).

Not covered: per-kind FFNs or norms (every block is norm -> mixer -> norm -> MoE/MLP), kinds
that need inputs other than the `SequenceMixer` call's.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jax

# The decode cache of one layer: leaf name -> array with the batch first ([B, ...]). Each kind
# names its own as a TypedDict (model/layers/kda.py: KDACache, dsa.py: DSACache).
LayerCache = dict[str, Any]


class SequenceMixer(Protocol):
    """What the transformer block builds and calls for every layer kind.

    Built as layer(cfg, d_model, eps, dtype, param_dtype, name="attn") with cfg its section.
    __call__: x [B,T,D], valid [B,T] bool, positions [B,T] int32; with a cache, offset [B] = the
      tokens each row already holds. Returns (out [B,T,D], new cache or None, aux {name: scalar}).
      Tokens with valid=False must leave the cache as if they were not there. step_caches=True
      (speculative verification, with a cache): return the candidates after every prefix 0..T
      of the new tokens, in whatever form select_step_cache reads.
    init_cache: the empty cache for `batch` rows of up to `max_len` tokens.
    select_step_cache: from step_caches candidates keep, per row b, the one after n[b] tokens.
    """

    cfg: Any
    d_model: int
    eps: float
    dtype: Any
    param_dtype: Any

    def __call__(self, x: jax.Array, *, valid: jax.Array, positions: jax.Array,
                 cache: LayerCache | None = None, offset: jax.Array | None = None,
                 step_caches: bool = False
                 ) -> tuple[jax.Array, LayerCache | None, dict[str, jax.Array]]: ...

    @staticmethod
    def init_cache(cfg: Any, batch: int, max_len: int, dtype: Any) -> LayerCache: ...

    @staticmethod
    def select_step_cache(step_cache: LayerCache, n: jax.Array) -> LayerCache: ...


_LAYER_FIELDS = ("cfg", "d_model", "eps", "dtype", "param_dtype")
_LAYER_METHODS = ("__call__", "init_cache", "select_step_cache")


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One layer kind (module docstring)."""

    name: str
    section: str
    layer: type
    config: type
    cache_axes: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    device_slice: Callable[[Any, Callable[[int], int], str], Any] | None = None

    def slice_for_device(self, section_cfg, heads: Callable[[int], int], kernels: str):
        return section_cfg if self.device_slice is None else self.device_slice(
            section_cfg, heads, kernels)


_BUILTIN: dict[str, str] = {
    "K": "model.layers.kda:KIND",  # Kimi Delta Attention (linear, O(1) state)
    "D": "model.layers.dsa:KIND",  # DeepSeek Sparse Attention (MLA + lightning indexer)
}
_KINDS: dict[str, LayerKind] = {}
# section names no kind may take: ModelConfig's fields (`reserve_sections`)
_RESERVED: set[str] = set()


def _load_builtins() -> None:
    for letter, where in _BUILTIN.items():
        if letter not in _KINDS:
            module, attr = where.split(":")
            kind = getattr(importlib.import_module(module), attr)
            _KINDS[letter] = _checked(letter, kind)


def kinds() -> dict[str, LayerKind]:
    """letter -> LayerKind, built-in kinds first (in `_BUILTIN` order), then registered ones."""
    _load_builtins()
    order = [*_BUILTIN, *(k for k in _KINDS if k not in _BUILTIN)]
    return {k: _KINDS[k] for k in order}


def get(letter: str) -> LayerKind:
    ks = kinds()
    if letter not in ks:
        raise KeyError(f"unknown layer letter {letter!r}; registered: {sorted(ks)}")
    return ks[letter]


def sections() -> dict[str, LayerKind]:
    """ModelConfig section name -> LayerKind."""
    return {k.section: k for k in kinds().values()}


def register(letter: str, kind: LayerKind) -> None:
    """Add a kind under `letter` (one character, not taken; its section name not taken)."""
    ks = kinds()
    if not (isinstance(letter, str) and len(letter) == 1 and not letter.isspace()):
        raise ValueError(f"a layer letter is one non-space character, got {letter!r}")
    if letter in ks:
        raise ValueError(f"layer letter {letter!r} is taken by {ks[letter].name!r}; "
                         "unregister it first or pick another letter")
    kind = _checked(letter, kind)
    if kind.section in _RESERVED or kind.section in sections():
        raise ValueError(_taken(kind))
    _KINDS[letter] = kind


def reserve_sections(names: Iterable[str]) -> None:
    """Keep `names` from being any registered kind's section: model/config.py reserves its
    ModelConfig field names when it is imported. Raises when a kind registered earlier (not a
    built-in one, whose sections are ModelConfig fields) already took one."""
    names = set(names)
    for letter, kind in _KINDS.items():
        if letter not in _BUILTIN and kind.section in names:
            raise ValueError(_taken(kind))
    _RESERVED.update(names)


def _taken(kind: LayerKind) -> str:
    return (f"layer kind {kind.name!r}: section name {kind.section!r} is taken "
            "(a ModelConfig field or another kind's section)")


def unregister(letter: str) -> LayerKind:
    """Remove a registered kind (built-in kinds stay) and return it."""
    if letter in _BUILTIN:
        raise ValueError(f"{letter!r} is a built-in layer kind and cannot be unregistered")
    if letter not in _KINDS:
        raise KeyError(f"no registered layer kind {letter!r}")
    return _KINDS.pop(letter)


def _checked(letter: str, kind: LayerKind) -> LayerKind:
    """The kind, after checking its layer follows SequenceMixer and its config is a frozen
    dataclass with validate(model, section): a clear error here instead of one at trace time."""
    what = f"layer kind {letter!r} ({getattr(kind, 'name', kind)!r})"
    if not isinstance(kind, LayerKind):
        raise TypeError(f"{what}: expected a LayerKind, got {type(kind).__name__}")
    missing = [m for m in _LAYER_METHODS if not callable(getattr(kind.layer, m, None))]
    fields = ({f.name for f in dataclasses.fields(kind.layer)}
              if dataclasses.is_dataclass(kind.layer) else set())
    missing += [f for f in _LAYER_FIELDS if f not in fields]
    if missing:
        raise TypeError(f"{what}: {kind.layer.__name__} does not follow SequenceMixer, missing "
                        f"{missing} (model/layers/registry.py)")
    params = getattr(kind.config, "__dataclass_params__", None)
    if params is None or not params.frozen or not callable(getattr(kind.config, "validate", None)):
        raise TypeError(f"{what}: config {kind.config.__name__} must be a frozen dataclass with "
                        "validate(model, section)")
    return kind
