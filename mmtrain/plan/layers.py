"""The fast plan: one decoder layer per kind traced, then scaled to the config's layer counts.

Identical layers have identical memory, traffic and FLOPs: a decoder layer is one of four kinds
(dense / MoE FFN x full / sparse attention), a vision block one kind. `scaled_trace` traces a
reduced model holding each kind once (`base`, vision depth 1), and for every kind the config has
more than once, the base plus one more layer of that kind (`plus`); per category, per collective
and per FLOP component, the config's value is then

    base + sum over kinds of (count of the kind - 1) x (plus - base)

Traffic and FLOPs are sums over layers (FSDP2 gathers and reduce-scatters each layer on its own,
EP's all-to-alls are per MoE layer): the same numbers as the full trace (to float rounding). The
peak is a sum of per-layer state (parameters, gradients, optimizer state, checkpointed inputs)
and of what lives at the peak's moment (gathered weights, a layer's recompute): the same when the
peak stays at the same point of the step, as it does for a stack of identical layers
(tests/mmtrain/test_plan.py compares it with the full trace). The reference: `--exact` (every
layer traced, torch's FSDPMemTracker).

Reduced models keep the dense layers first (`moe.first_dense_layers`) and spell `layer_layout` out.
"""

from __future__ import annotations

import copy

Kind = tuple[bool, bool]  # (MoE FFN, sparse attention)
VISION = "vision block"


def kind_name(kind: Kind | str) -> str:
    if isinstance(kind, str):
        return kind
    return f"{'moe' if kind[0] else 'dense'} {'sparse' if kind[1] else 'full'}"


def counts(cfg) -> dict:
    """kind -> how many the config has (decoder kinds in first-layer order, dense first; vision)."""
    out: dict = {}
    for kind in sorted(cfg.model.decoder.layer_kinds(), key=lambda k: k[0]):  # stable: dense first
        out[kind] = out.get(kind, 0) + 1
    out[VISION] = cfg.model.vision.depth
    return out


def reduced(cfg, layers: list[Kind], depth: int):
    """A copy of cfg whose decoder has exactly `layers` (dense ones first) and `depth` vision blocks."""
    out = copy.deepcopy(cfg)
    dec = out.model.decoder
    dec.n_layers = len(layers)
    dec.layer_layout = "".join("S" if sparse else "F" for _, sparse in layers)
    if dec.moe is not None:
        dec.moe.first_dense_layers = sum(not moe for moe, _ in layers)
    out.model.vision.depth = depth
    return out


def plan_traces(cfg) -> list[tuple[object, object | None]]:
    """[(config to trace, the kind it adds to the base or None for the base)]."""
    n = counts(cfg)
    base = [k for k in n if k != VISION]
    out = [(reduced(cfg, base, 1), None)]
    for kind, count in n.items():
        if count < 2:
            continue
        if kind == VISION:
            out.append((reduced(cfg, base, 2), kind))
        else:
            i = base.index(kind)
            out.append((reduced(cfg, base[:i + 1] + [kind] + base[i + 1:], 1), kind))
    return out


FIXED_BLOCKS = 3  # a trace's own cost beyond its blocks (embedding, head, loss, optimizer), in blocks


def worth_it(cfg) -> bool:
    """Scaling pays when the reduced models' traces cost less than the config's one trace: each
    costs its blocks (decoder layers, vision blocks) plus about FIXED_BLOCKS (measured on m3's
    shapes, docs/BENCHMARKS.md)."""
    traces = plan_traces(cfg)
    traced = sum(c.model.decoder.n_layers + c.model.vision.depth + FIXED_BLOCKS for c, _ in traces)
    return traced < cfg.model.decoder.n_layers + cfg.model.vision.depth + FIXED_BLOCKS


def scaled_trace(cfg, opts):
    """The Trace of `cfg` from its reduced models' traces (module docstring)."""
    from mmtrain.plan.trace import trace

    n = counts(cfg)
    runs = [(trace(c, opts), kind) for c, kind in plan_traces(cfg)]
    base = runs[0][0]
    extra = [(t, n[kind] - 1) for t, kind in runs[1:]]
    return _extrapolated(base, extra, cfg)


def _scale(base: dict, extra: list[tuple[dict, int]]) -> dict:
    keys = list(dict.fromkeys([*base, *(k for d, _ in extra for k in d)]))
    return {k: base.get(k, 0) + sum(m * (d.get(k, 0) - base.get(k, 0)) for d, m in extra) for k in keys}


def _extrapolated(base, extra: list, cfg):
    peak = {k: max(0.0, v) for k, v in _scale(base.peak, [(t.peak, m) for t, m in extra]).items()}
    comm_calls = _scale({k: v[0] for k, v in base.comm.items()}, [({k: v[0] for k, v in t.comm.items()}, m)
                                                                  for t, m in extra])
    comm_bytes = _scale({k: v[1] for k, v in base.comm.items()}, [({k: v[1] for k, v in t.comm.items()}, m)
                                                                  for t, m in extra])
    flops = _scale(base.flops, [(t.flops, m) for t, m in extra])
    out = copy.copy(base)
    out.peak, out.flops = peak, flops
    out.own_counts = _scale(base.own_counts, [(t.own_counts, m) for t, m in extra])
    out.comm = {k: [comm_calls[k], comm_bytes[k]] for k in comm_calls}
    added = sum(peak.values()) - base.total
    out.modules = [(_real_name(name, cfg), b + added) for name, b in base.modules]
    return out


def _real_name(fqn: str, cfg) -> str:
    """A reduced model's `decoder.layers.i` -> `decoder.layers[kind]` (any layer of that kind)."""
    parts = fqn.split(".")
    if "layers" not in parts:
        return fqn
    i = parts.index("layers")
    base = [k for k in counts(cfg) if k != VISION]
    try:
        kind = base[int(parts[i + 1])]
    except (ValueError, IndexError):
        return fqn
    return ".".join(parts[:i + 1]) + f"[{kind_name(kind)}]" + "".join("." + p for p in parts[i + 2:])
