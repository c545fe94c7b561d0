"""The attention backends as a registry: what each computes, where, and where a call it cannot do goes.

    register_backend(Backend("mine", run_mine, layers=BOTH, devices=ANY, train=ANY))  # in mine.py
    backend = resolve(cfg, q_BHSD, meta, sparse)  # the one choice: eager, compiled and op bodies
    out_BHSD = backend.run(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel)  # sel: the Selection, None if full

Every backend computes the same function (the token rule, and on sparse layers the block rule).
An entry states: `layers` (full / sparse); `devices` its forward runs on and `train` those with a
backward ("any": all; auto and fallbacks pick only where it trains); an optional `package`; a
per-call `usable` check (host values allowed; skipped under compile for its `opaque` kinds);
`opaque`: layer kind -> the custom op it runs as under torch.compile (opaque.py, whose body calls
`resolve` again); `saved`: a sparse forward that also returns the log-sum-exp and the backward
from it; `decode`; `fallback` (where a call it cannot compute goes: the first that trains there
and is usable). `auto` walks the backends with an `auto` rank, lowest first. `knockout`: it
applies a key knockout (knockout.py); a call with one that the asked backend does not apply runs
on `dense`, the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .meta import AttnMeta

if TYPE_CHECKING:
    from .config import AttentionConfig

Tensor = torch.Tensor
FULL, SPARSE = "full", "sparse"
BOTH = frozenset({FULL, SPARSE})
ANY = ("any",)


def _always(q_BHSD: Tensor, meta: AttnMeta) -> bool:
    return True


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[..., Tensor]  # (q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel) -> (B, H, S, D)
    layers: frozenset[str]  # FULL, SPARSE
    devices: tuple[str, ...]  # device types its forward runs on
    train: tuple[str, ...]  # device types it has a backward on (auto and fallbacks: only these)
    package: str = ""  # an optional package it needs ("": none)
    usable: Callable[[Tensor, AttnMeta], bool] = _always  # the per-call check (host values allowed)
    opaque: Mapping[str, Callable[..., Tensor]] = field(default_factory=dict)  # kind -> its op
    saved: tuple[Callable[..., tuple[Tensor, Tensor] | None], Callable[..., tuple | None]] | None = None
    decode: bool = False
    fallback: tuple[str, ...] = ()
    auto: int = 0  # rank among auto's candidates (1 first); 0: not a candidate
    knockout: bool = False  # applies AttnMeta.knock_BS (knockout.py)

    def runs_on(self, device: str, backward: bool = False) -> bool:
        where = self.train if backward else self.devices
        return "any" in where or device in where


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    if backend.name in BACKENDS or backend.name == "auto":
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    BACKENDS[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    del BACKENDS[name]


def backend_choices() -> tuple[str, ...]:
    """The values `AttentionConfig.backend` accepts."""
    return ("auto", *BACKENDS)


def auto_order() -> tuple[str, ...]:
    return tuple(sorted((b.name for b in BACKENDS.values() if b.auto), key=lambda n: BACKENDS[n].auto))


@functools.cache
def package_available(package: str, backend: str) -> bool:
    if importlib.util.find_spec(package) is not None:
        return True
    warnings.warn(f"{package} is not installed: the {backend} attention backend falls back "
                  f"(pip install 'mmtrain[cuda]' for it)", stacklevel=4)
    return False


def _can(b: Backend, kind: str, q_BHSD: Tensor, meta: AttnMeta, backward: bool) -> bool:
    """Whether b computes this call: layer kind, device, package, then the per-call check."""
    if kind not in b.layers or not b.runs_on(q_BHSD.device.type, backward):
        return False
    if b.package and not package_available(b.package, b.name):
        return False
    return (kind in b.opaque and torch.compiler.is_compiling()) or b.usable(q_BHSD, meta)


def resolve(cfg: AttentionConfig, q_BHSD: Tensor, meta: AttnMeta, sparse: bool) -> Backend:
    """The backend that runs this call: cfg.backend if it can compute it, else the first of its
    fallbacks (of auto's candidates for "auto") that trains on this device and is usable."""
    kind = SPARSE if sparse else FULL
    if meta.knock_BS is not None:  # a key knockout: the asked backend if it applies it, else dense
        asked = BACKENDS.get(cfg.backend)
        ok = asked is not None and asked.knockout and _can(asked, kind, q_BHSD, meta, backward=False)
        return asked if ok else BACKENDS["dense"]
    if cfg.backend != "auto":
        asked = BACKENDS[cfg.backend]
        if _can(asked, kind, q_BHSD, meta, backward=False):
            return asked
    names = auto_order() if cfg.backend == "auto" else BACKENDS[cfg.backend].fallback
    for name in names:
        if _can(BACKENDS[name], kind, q_BHSD, meta, backward=True):
            return BACKENDS[name]
    raise ValueError(f"backend: no attention backend of {(cfg.backend, *names)} computes a {kind} layer "
                     f"on {q_BHSD.device.type}")
