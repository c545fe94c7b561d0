"""The plan as a dict (`--json`) and as text: memory against the GPU, collectives by mesh
dimension, FLOPs by component, and a roofline step time.

Roofline (stated, not measured): compute = hardware FLOPs / bf16 peak; HBM = 3 x the activations
(written in forward, read in backward, their gradients) + 2 x (parameters, gradients, optimizer
state) for the optimizer step, over the HBM bandwidth; communication per link = the wire bytes of
the groups inside a node over NVLink's bandwidth, of the groups across nodes over the NIC's. The
step time is the largest of the three if communication overlaps compute fully, their sum if it
does not; `overlap needed` is the share of the communication that must hide behind compute for
the step to be compute-bound. MFU = model FLOPs / (step time x peak).
"""

from __future__ import annotations

from mmtrain.plan.flops import model_flops
from mmtrain.plan.gpus import GPU, MARGIN_GIB
from mmtrain.plan.loader import text as loader_text

GIB = 2**30


def build(config: str, trace, gpu: GPU, gpus: int, params: dict, vision: dict | None = None) -> dict:
    peak = trace.total
    comm = _comm(trace, gpu)
    flops = trace.flops
    hw = sum(flops.values())
    bubble = trace.pipeline.get("bubble", 0.0)  # pp: the schedule's idle share (pipe.py, closed form)
    compute_s = hw / (gpu.bf16_tflops * 1e12) / (1 - bubble)
    state = sum(trace.peak.get(k, 0) for k in ("parameters", "gradients", "optimizer state"))
    hbm_s = (3 * trace.peak.get("activations", 0) + 2 * state) / (gpu.hbm_tbps * 1e12)
    links = {"intra-node": comm["intra_s"], "inter-node": comm["inter_s"]}
    busy = max(compute_s, hbm_s)
    step_overlapped = max(busy, *links.values())
    step_serial = busy + sum(links.values())
    comm_s = sum(links.values())
    return {
        "config": config, "gpus": gpus, "gpu": gpu.name, "rank": trace.rank, "mesh": trace.mesh,
        "params": params,
        "batch": {"tokens_per_rank": trace.tokens, "visual_tokens": trace.visual_tokens,
                  "patches": trace.patches},
        "memory": {"peak_bytes": peak, "by_category": trace.peak,
                   "top_modules": [{"module": m, "bytes": b} for m, b in trace.modules],
                   "gpu_bytes": gpu.memory_gib * GIB, "margin_bytes": MARGIN_GIB * GIB,
                   "usable_bytes": gpu.usable_bytes, "fits": peak <= gpu.usable_bytes},
        "comm": comm["rows"],
        "flops": {"by_component": flops, "hardware": hw, "model": model_flops(flops)},
        "roofline": {"compute_s": compute_s, "hbm_s": hbm_s, "comm_intra_s": links["intra-node"],
                     "comm_inter_s": links["inter-node"], "step_s_overlapped": step_overlapped,
                     "step_s_serial": step_serial,
                     "overlap_needed": max(0.0, 1 - busy / comm_s) if comm_s > busy else 0.0,
                     "mfu_overlapped": model_flops(flops) / (step_overlapped * gpu.bf16_tflops * 1e12),
                     "mfu_serial": model_flops(flops) / (step_serial * gpu.bf16_tflops * 1e12),
                     "pp_bubble": bubble,
                     "specs": {"bf16_tflops": gpu.bf16_tflops, "hbm_tbps": gpu.hbm_tbps,
                               "intra_gbps": gpu.intra_gbps, "inter_gbps": gpu.inter_gbps}},
        "vision": vision or {},
        "pipeline": trace.pipeline,
    }


def _comm(trace, gpu: GPU) -> dict:
    rows, intra, inter = [], 0.0, 0.0
    for (dim, kind), (calls, nbytes) in sorted(trace.comm.items()):
        across = any(trace.crosses.get(d, False) for d in dim.split("/"))
        seconds = nbytes / ((gpu.inter_gbps if across else gpu.intra_gbps) * 1e9)
        rows.append({"dim": dim, "kind": kind, "calls": int(calls), "bytes": nbytes,
                     "across_nodes": across, "seconds": seconds})
        inter, intra = (inter + seconds, intra) if across else (inter, intra + seconds)
    return {"rows": rows, "intra_s": intra, "inter_s": inter}


def text(plan: dict) -> str:
    m, r = plan["memory"], plan["roofline"]
    verdict = "fits" if m["fits"] else "DOES NOT FIT"
    lines = [f"{plan['config']} on {plan['gpus']} x {plan['gpu']} (mesh {_mesh(plan['mesh'])}), rank "
             f"{plan['rank']}: {plan['batch']['tokens_per_rank']:,} tokens a micro-batch "
             f"({plan['batch']['visual_tokens']:,} visual), params "
             f"{plan['params']['total'] / 1e9:.2f}B total / {plan['params']['active'] / 1e9:.2f}B active",
             f"memory: peak {m['peak_bytes'] / GIB:.2f} GiB of {m['usable_bytes'] / GIB:.1f} GiB usable "
             f"({m['gpu_bytes'] / GIB:.0f} GiB - {m['margin_bytes'] / GIB:.0f} GiB margin): {verdict}"]
    by_size = sorted(m["by_category"].items(), key=lambda kv: -kv[1])
    lines += [f"  {k:<18}{v / GIB:9.2f} GiB" for k, v in by_size]
    lines.append("  top modules (peak while they run):")
    lines += [f"    {t['module']:<52}{t['bytes'] / GIB:9.2f} GiB" for t in m["top_modules"]]
    if plan.get("caveat"):
        lines.insert(0, f"note: {plan['caveat']}")
    lines.append("collectives per step (wire bytes this rank sends):")
    lines += [f"  {c['dim']:<17}{c['kind']:<15}{c['calls']:5d} calls {c['bytes'] / GIB:9.3f} GiB "
              f"{'across nodes' if c['across_nodes'] else 'in node':<13}{c['seconds'] * 1e3:8.1f} ms"
              for c in plan["comm"]]
    f = plan["flops"]
    lines.append(f"FLOPs per step: {f['model'] / 1e12:.1f} TFLOP model, {f['hardware'] / 1e12:.1f} hardware")
    lines += [f"  {k:<18}{v / 1e12:10.2f} TFLOP {v / max(f['hardware'], 1):6.1%}"
              for k, v in f["by_component"].items() if v]
    lines.append(f"roofline: compute {r['compute_s']:.3f} s, HBM {r['hbm_s']:.3f} s, communication "
                 f"{r['comm_intra_s']:.3f} s in node + {r['comm_inter_s']:.3f} s across; step "
                 f"{r['step_s_overlapped']:.3f} s overlapped (MFU {r['mfu_overlapped']:.1%}) .. "
                 f"{r['step_s_serial']:.3f} s serial (MFU {r['mfu_serial']:.1%}); overlap needed "
                 f"{r['overlap_needed']:.0%}")
    lines += _pipeline(plan.get("pipeline") or {})
    lines += _vision(plan.get("vision") or {})
    lines += loader_text(plan.get("loader") or {})
    return "\n".join(lines)


def _pipeline(p: dict) -> list[str]:
    if not p:
        return []
    layers = (f"decoder layers {p['layers'][0]}..{p['layers'][-1]} traced" if p["layers"] else
              "no decoder layer: one traced for memory, its FLOPs not counted")
    split = p["split"] if p.get("split_by") != "measured" else \
        f"{p['split']}: the FLOP split; dist.pp_split: measured cuts by times taken at launch"
    return [f"pipeline: {p['schedule']}, stages {p['stages']} of {p['n_stages']} ({layers}; "
            f"split {split}), {p['microbatches']} "
            f"micro-batches, {p['in_flight']:g} in flight at the peak, bubble {p['bubble']:.0%} (closed form "
            f"(pp - 1) / (v m + pp - 1), in the roofline's compute time)"]


def _vision(v: dict) -> list[str]:
    """The encoder's modelled cost per rank (a n^2 + b n + c a medium), each balance mode."""
    if not v or not v["modes"]:
        return []
    a, b, c = v["cost"]
    none = v["modes"]["none"]["max"]
    lines = [f"vision encoder cost per rank ({a:g} n^2 + {b:g} n + {c:g} a medium of n patches; "
             f"vision.balance: {v['balance']}):"]
    lines += [f"  {mode:<8}{'(configured)' if mode == v['balance'] else '':<14}busiest {m['max']:.3g} "
              f"({m['max'] / none if none else 1:.0%} of none), mean {m['mean']:.3g}, busiest / mean "
              f"{m['max_over_mean']:.2f}" for mode, m in v["modes"].items()]
    return lines


def _mesh(mesh: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "1 rank"
