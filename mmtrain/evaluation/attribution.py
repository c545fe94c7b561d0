"""Where a word reads in a medium, by several attributions over its visual tokens (what the
knockout test in knockout.py ranks keys by). For a word (its predictor rows: the rows whose
logits give its tokens) and the medium it names:

  raw L<l>     attention of layer l, mean of heads (and of the word's rows);
  raw mean     the same, mean over layers (the pointing game's "mean map");
  rollout      attention rollout (Abnar & Zuidema 2020): the product over layers of
               0.5 * mean-of-heads attention + 0.5 * I (the residual), rows of the word;
  grad L<l>    gradient-weighted attention of layer l, E_h[(dA ⊙ A)^+] (Chefer et al. 2021),
               dA the gradient of the word's log-probability w.r.t. the attention probabilities;
  grad         those propagated over the layers, R = I; R += E_h[(dA ⊙ A)^+] R (Chefer et al.
               2021, "generic attention-model explainability", eq. 6);
  heads        the mean of chosen heads' maps (`pick_heads`: localisation heads, Kang et al. 2025).

Attention probabilities are recomputed with each layer's exact mask (models.attention.recompute_probs).
Their gradient needs no probabilities from the kernel: the output of head h at row i is
sum_j A[h, i, j] v[j], so dA[h, i, j] = dO[h, i] . v[j]; dO is the gradient at the input of the
layer's output projection and v the value projection, both read by hooks on the decoder's layers.

Legend: L layers, H heads, K kv heads, S tokens, E head dim, R rows, V visual tokens of the medium.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmtrain.models.attention import build_meta, recompute_probs
from mmtrain.models.self_attention import split_qkv

Tensor = torch.Tensor
DEFAULT_LAYER = 2  # docs/ATTENTION_MAPS.md, "Faithfulness": the most faithful layer on make train's val


def default_method(n_layers: int) -> str:
    """The map the diagnostics and the video report use: raw attention of layer 2 (on make train's
    finished checkpoint as faithful as the best, gradient-weighted attention of that layer -- deletion
    z 40.86 both -- through the randomisation check, and, unlike any gradient map, no better than random
    orders on a shuffled checkpoint; no backward pass), the last layer's in a shallower decoder."""
    return f"raw L{min(DEFAULT_LAYER, n_layers - 1)}"


@dataclass
class WordSpan:
    """A scored word: its tokens [start, end) and the medium's visual tokens [vis0, vis0 + n_vis)."""

    start: int
    end: int
    vis0: int
    n_vis: int

    @property
    def rows(self) -> list[int]:
        """The predictor rows: row p - 1 gives token p."""
        return list(range(self.start - 1, self.end - 1))


def method_names(n_layers: int) -> list[str]:
    return ([f"raw L{l}" for l in range(n_layers)] + ["raw mean", "rollout"]
            + [f"grad L{l}" for l in range(n_layers)] + ["grad", "heads"])


def word_logprob(model, hidden_BSD: Tensor, tokens_BS: Tensor, w: WordSpan) -> Tensor:
    """(B,) log-probability of the word's tokens from the hidden states of every batch row."""
    logits_BRV = model.logits(hidden_BSD[:, w.rows]).float()
    tgt_BR = tokens_BS[:, w.start:w.end].expand(logits_BRV.shape[0], -1)
    return logits_BRV.log_softmax(-1).gather(-1, tgt_BR[..., None])[..., 0].sum(-1)


class _Taps:
    """Forward hooks on every decoder layer: v (from the qkv projection) and the attention output
    (the input of the output projection), kept in the graph for their gradients."""

    def __init__(self, model) -> None:
        self.v, self.o, self.handles = {}, {}, []
        dec = model.cfg.decoder
        H, K, E = dec.n_heads, dec.n_kv_heads, dec.head_dim
        for l, layer in enumerate(model.decoder.layers):
            def take_v(mod, inp, out, l=l):
                self.v[l] = split_qkv(out, H, K, E)[2].detach()  # (B, S, K, E)

            def take_o(mod, inp, l=l):
                self.o[l] = inp[0]  # (B, S, H * E)
            self.handles += [layer.attn.wqkv.register_forward_hook(take_v),
                             layer.attn.wo.register_forward_pre_hook(take_o)]
        # the embeddings as a leaf that needs grad: a graph without touching the parameters' flags
        self.handles.append(model.decoder.embed.register_forward_hook(
            lambda mod, inp, out: out.detach().requires_grad_()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def doc_attributions(model, inputs: dict[str, Tensor], words: list[WordSpan]) -> list[dict]:
    """Per word: {method: (V,) map} (method_names) and "per_head": (L, H, V) raw maps, for a
    one-row batch `inputs` (model.forward's keyword arguments). One forward, one backward per word."""
    dec = model.cfg.decoder
    L, H, K = dec.n_layers, dec.n_heads, dec.n_kv_heads
    taps = _Taps(model)
    try:
        with torch.enable_grad():
            out = model(**inputs, capture_layers=list(range(L)), compute_logits=False)
            meta = build_meta(inputs["doc_ids_BS"], inputs["span_ids_BS"], dec.attention.block_size)
            S = inputs["tokens_BS"].shape[1]
            all_S = torch.arange(S, device=out.hidden_BSD.device)
            with torch.no_grad():
                A_LHSS = torch.stack([recompute_probs(out.captures[l], meta, dec.attention, dec.is_sparse(l),
                                                      all_S) for l in range(L)])
            outs = []
            for w in words:
                lp = word_logprob(model, out.hidden_BSD, inputs["tokens_BS"], w)[0]
                dO = torch.autograd.grad(lp, [taps.o[l] for l in range(L)], retain_graph=True)
                with torch.no_grad():
                    dA_LHSS = torch.stack([_grad_probs(dO[l][0], taps.v[l][0], H, K) for l in range(L)])
                    outs.append(_word_maps(A_LHSS, dA_LHSS, w))
    finally:
        taps.close()
    return outs


def _grad_probs(dO_SF: Tensor, v_SKE: Tensor, H: int, K: int) -> Tensor:
    """(H, S, S) dA[h, i, j] = dO[i, h] . v[j, kv(h)]."""
    S, _ = dO_SF.shape
    dO_HSE = dO_SF.view(S, H, -1).transpose(0, 1).float()
    v_HSE = v_SKE.transpose(0, 1).float().repeat_interleave(H // K, 0)
    return dO_HSE @ v_HSE.transpose(-1, -2)


def _word_maps(A_LHSS: Tensor, dA_LHSS: Tensor, w: WordSpan) -> dict:
    L, H, S, _ = A_LHSS.shape
    rows, vis = w.rows, slice(w.vis0, w.vis0 + w.n_vis)
    maps: dict = {}
    raw_LV = A_LHSS.mean(1)[:, rows, vis].mean(1)
    for l in range(L):
        maps[f"raw L{l}"] = raw_LV[l]
    maps["raw mean"] = raw_LV.mean(0)
    eye_SS = torch.eye(S, dtype=A_LHSS.dtype)
    roll_SS = eye_SS
    for l in range(L):
        roll_SS = (0.5 * A_LHSS[l].mean(0) + 0.5 * eye_SS) @ roll_SS
    maps["rollout"] = roll_SS[rows, vis].mean(0)
    gae_SS = eye_SS
    for l in range(L):
        bar_SS = (dA_LHSS[l] * A_LHSS[l]).clamp_min(0).mean(0)
        maps[f"grad L{l}"] = bar_SS[rows, vis].mean(0)
        gae_SS = gae_SS + bar_SS @ gae_SS
    maps["grad"] = gae_SS[rows, vis].mean(0)
    out = {k: v.double().numpy() for k, v in maps.items()}
    out["per_head"] = A_LHSS[:, :, rows, vis].mean(2).double().numpy()
    return out


def head_scores(per_head: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(L, H) mean visual mass and mean spatial entropy (nats, of the map normalised over the
    medium's tokens) of every head over words' (L, H, V) maps."""
    mass = np.mean([m.sum(-1) for m in per_head], axis=0)
    ent = []
    for m in per_head:
        p = m / np.clip(m.sum(-1, keepdims=True), 1e-12, None)
        ent.append(-(p * np.log(np.clip(p, 1e-12, None))).sum(-1) / np.log(m.shape[-1]))
    return mass, np.mean(ent, axis=0)


def pick_heads(per_head: list[np.ndarray], n: int = 3) -> list[tuple[int, int]]:
    """Localisation heads (Kang et al. 2025): among the heads whose visual mass is at least the
    median head's, the n of lowest spatial entropy (entropy normalised by log V per word)."""
    mass, ent = head_scores(per_head)
    ok = mass >= np.median(mass)
    order = sorted(zip(*np.nonzero(ok)), key=lambda lh: ent[lh])
    return [(int(l), int(h)) for l, h in order[:n]]


def heads_map(per_head_LHV: np.ndarray, heads: list[tuple[int, int]]) -> np.ndarray:
    """Mean of the chosen heads' maps, each normalised to sum 1 (a faint head counts as much)."""
    maps = [per_head_LHV[l, h] / max(per_head_LHV[l, h].sum(), 1e-12) for l, h in heads]
    return np.mean(maps, axis=0)
