"""Attention-map inspection: where text tokens look in images and video (`mmtrain-attn`).

Plotting-free parts:
    inputs   doc_from_sample / doc_from_file -> DocInputs (one document + layout, boxes)
    maps     analyze_document(model, doc, layers) -> DocAttention (recomputed rows: mass, entropy,
             sink, per-medium token-grid maps); batch_attention_stats(...) for packed batches
    metrics  pointing_trials / summarize_trials / AttentionTotals / Grounding (metrics.json content)
Pictures and the report: plots, render, report; the command line: cli (session runs one invocation).

They build on pieces that live below them and that the trainer's collapse diagnostics use directly
(the diagnostics do not import this package): mmtrain.inference.loading (load_model: checkpoint, run or export
directory), mmtrain.inference.prompts (read_sample, iter_val_samples), mmtrain.models.attention.stats (row
selection and reductions) and mmtrain.evaluation.pointing (the pointing game's geometry).
See docs/ATTENTION_MAPS.md.
"""

if __name__ != "mmtrain.attention_maps":  # the checkout's folder under its own name: a second copy
    raise ImportError(f"import mmtrain.attention_maps, not {__name__}: the folder is installed under that "
                      "name (pip install -e . or make install)")

