"""The one table of speculation methods: name -> class, availability rule, model-based or not.

Everything else derives from it: `METHODS` (what a request may name), the options check a front end runs
without loading models (`validator`), which speculators the engine builds and in what order
(`build_all`), the drafter KV memory per target block (`kv_bytes_per_block`), and the hybrid's fallback
order (`MODEL_DRAFTERS`: the model-based methods in table order). Classes are imported lazily, so the
table costs nothing to read where torch is not wanted.

Adding a method: one file with a `Speculator` subclass, one `Method(...)` line here
(docs/architecture.md lists what the class must implement).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import import_module

from specserve.speculators.base import BuildContext, SpecParams, Speculator


@dataclass(frozen=True)
class Method:
    name: str
    target: str            # "module:Class", a Speculator subclass
    needs: str             # the availability rule, as users read it in /v1/speculators and errors
    model_based: bool = False   # a drafter model: the hybrid falls back to the first one loaded

    def speculator_class(self) -> type[Speculator]:
        module, cls = self.target.split(":")
        return getattr(import_module(module), cls)


_P = "specserve.speculators."
TABLE: list[Method] = [
    Method("ngram", _P + "ngram:NgramSpeculator", "always"),
    Method("prediction", _P + "prediction:PredictionSpeculator", "always (drafts from the request's prediction)"),
    Method("eagle3", _P + "eagle3:Eagle3Speculator", "--eagle3 DIR, or the embedded family's head",
           model_based=True),
    Method("eagle", _P + "eagle3:EagleSpeculator", "--eagle DIR (an EAGLE-1 head), or the embedded family's",
           model_based=True),
    Method("mtp", _P + "mtp:MtpSpeculator", "a target checkpoint with num_nextn_predict_layers > 0",
           model_based=True),
    Method("draft", _P + "draft_model:DraftModelSpeculator", "--draft-model DIR, or the embedded family's draft",
           model_based=True),
    Method("hybrid", _P + "hybrid:HybridSpeculator", "any model-based drafter (eagle3, eagle, mtp or draft)"),
    Method("suffix", _P + "suffix:SuffixSpeculator", "always (drafts from this and earlier requests' texts)"),
    Method("auto", _P + "auto:AutoSpeculator", "always (chooses among the other loaded methods per step)"),
]
BY_NAME: dict[str, Method] = {}
METHODS: tuple[str, ...] = ()
MODEL_DRAFTERS: tuple[str, ...] = ()


def _index() -> None:
    """Derive the lookups from TABLE (read them as `registry.METHODS`: they change when a method registers)."""
    global METHODS, MODEL_DRAFTERS
    BY_NAME.clear()
    BY_NAME.update((m.name, m) for m in TABLE)
    METHODS = ("none", *BY_NAME)
    MODEL_DRAFTERS = tuple(m.name for m in TABLE if m.model_based)


_index()


def register(entry: Method) -> None:
    """Add a method at the end of the table (a plugin's own speculator); names are unique."""
    if entry.name in METHODS:
        raise ValueError(f"speculation method {entry.name!r} is already registered")
    TABLE.append(entry)
    _index()


@contextlib.contextmanager
def registered(entry: Method) -> Iterator[Method]:
    """`register` for the duration of a block (tests)."""
    register(entry)
    try:
        yield entry
    finally:
        TABLE.remove(entry)
        _index()


# The server default when `--speculation` is not given: the first of these that is loaded, with its k (capped by
# --max-speculative-tokens). Measured on the embedded family (docs/benchmarks.md, "2026-12-06 — ... the suffix
# index compiled; `auto` the default"): `auto` k = 8 ran at or above hybrid k = 4, the default before it, on every
# prompt set at batch 1 (T = 0 and 0.8) and at concurrency 16 in one whole-bench run (hybrid 0.87-1.07x plain
# decoding at 16, auto 1.00-1.71x), and in 14 of 15 cells of the next (code at T = 0.8: 1.08x against 1.09x).
# hybrid and ngram stay for engines a plugin built without `auto`.
DEFAULT_PREFERENCE = (("auto", 8), ("hybrid", 4), ("ngram", 4))


def default_speculation(loaded: Sequence[str], max_k: int) -> SpecParams:
    """What a request without a `speculation` field gets when the server was given no default.

    Example: loaded ["none", "ngram", "prediction", "eagle3", "hybrid", "auto"], max_k 8 -> auto, k = 8;
    max_k 2 -> auto, k = 2; loaded ["none", "ngram", "prediction"] -> ngram, k = 4; max_k 0 -> none.
    """
    for method, k in DEFAULT_PREFERENCE:
        if method in loaded and min(k, max_k) > 0:
            return SpecParams(method=method, num_speculative_tokens=min(k, max_k))
    return SpecParams()


def _no_options(options: dict) -> None:
    if options:
        raise ValueError(f"speculation method 'none' takes no options, got {sorted(options)}")


def validator(method: str) -> Callable[[dict], None]:
    """The options check of a method (ValueError -> HTTP 400), without loading any model."""
    if method == "none":
        return _no_options
    entry = BY_NAME.get(method)
    if entry is None:
        raise ValueError(f"unknown speculation method {method!r}; expected one of {list(METHODS)}")
    return entry.speculator_class().validate


def build_all(ctx: BuildContext) -> dict[str, Speculator]:
    """method -> loaded speculator, in table order, for every method whose requirements are met."""
    for entry in TABLE:
        spec = entry.speculator_class().build(ctx)
        if spec is not None:
            ctx.loaded[entry.name] = spec
    return ctx.loaded


def kv_bytes_per_block(ctx: BuildContext) -> int:
    """Drafter bytes per target KV block, summed over every method `build_all` would load."""
    return sum(entry.speculator_class().kv_bytes_per_block(ctx) for entry in TABLE)
