"""Peak memory of the loss's forward + backward at a config's shapes, reference vs chunked, on CPU.

    python -m tools.bench.bench_loss_memory                           # long.yaml: 1 x 65536, D 1536, V 32768
    python -m tools.bench.bench_loss_memory --rows 1 --seq 65536 --dim 1536 --vocab 32768 --chunk 2048 4096

What is measured: from the decoder's final hidden states (B, S, D) and the LM head (V, D) to the
gradients of both, the objective's token part -- the head, per-token CE, hits, logsumexp, the
per-task sums, a z-loss -- as `loss.ce_chunk: 0` (the reference, `heads.FullHead` over the model's
full logits) and `loss.ce_chunk: C` (`heads.ChunkedHead`) build it. No arithmetic runs: the tensors
are fake (FakeTensorMode) and torch's MemTracker (torch.distributed._tools.mem_tracker) counts
every storage allocated and freed, so the shapes of a 64k-token row cost no memory here. Reported:
the peak above the inputs (hidden, head, labels), in GiB and as a share of one fp32 (B, S, V).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--autocast", choices=["none", "bfloat16"], default="none",
                   help="bfloat16: the head's matmuls under CPU autocast, as train.dtype on a GPU")
    return p.parse_args(argv)


def _loss(hidden_BSD, weight_VD, labels_BS, task_BS, chunk: int) -> torch.Tensor:
    """The objective's token part: the head (full or chunked), task sums, z-loss."""
    from mmtrain.objectives.heads import ChunkedHead, FullHead
    from mmtrain.objectives.terms import task_sums, weighted_total, z_loss_of

    head = (ChunkedHead(hidden_BSD, weight_VD, labels_BS, chunk) if chunk
            else FullHead(F.linear(hidden_BSD, weight_VD), labels_BS))  # as decoder.logits
    ce_BS, hit_BS = head.ce(0, labels_BS.shape[0])
    losses = task_sums(ce_BS, hit_BS, labels_BS, task_BS)
    total = weighted_total(losses, {"text": 1.0, "image_text": 1.0, "video_text": 1.0})
    return total + 1e-4 * z_loss_of(head.lse(0, labels_BS.shape[0]), labels_BS)


def peak_bytes(B: int, S: int, D: int, V: int, chunk: int, autocast: bool = False) -> int:
    """Peak bytes above the inputs of the loss's forward + backward (`chunk` 0: the reference);
    `autocast`: the head under bf16 autocast (fp32 leaves, as the model's parameters)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        hidden_BSD = torch.randn(B, S, D, requires_grad=True)
        weight_VD = torch.randn(V, D, requires_grad=True)
        labels_BS, task_BS = torch.randint(0, V, (B, S)), torch.zeros(B, S, dtype=torch.int8)
        inputs = [hidden_BSD, weight_VD, labels_BS, task_BS]
        tracker = MemTracker()
        tracker.track_external(*inputs)
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(hidden_BSD, weight_VD, labels_BS, task_BS, chunk)
        with tracker:
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak - sum(t.numel() * t.element_size() for t in inputs)


def main(argv=None) -> None:
    a = parse_args(argv)
    full = a.rows * a.seq * a.vocab * 4
    print(f"B={a.rows} S={a.seq} D={a.dim} V={a.vocab} autocast {a.autocast}: "
          f"one fp32 (B, S, V) = {full / GiB:.2f} GiB")
    for chunk in [0, *a.chunk]:
        peak = peak_bytes(a.rows, a.seq, a.dim, a.vocab, chunk, a.autocast == "bfloat16")
        name = "reference (full logits)" if not chunk else f"chunked, {chunk} tokens"
        print(f"{name:>26}: peak {peak / GiB:6.2f} GiB = {peak / full:.3f} x (B, S, V)")


if __name__ == "__main__":
    main()
