"""Attention-map inspection: where text tokens look in images and video (`mmtrain-attn`).

Reusable, plotting-free parts (the collapse diagnostics use them):
    inputs   doc_from_sample / doc_from_file / iter_val_samples -> DocInputs (one document + layout, boxes)
    loading  load_model(ckpt) -> Loaded (model, run config, tokenizer) via mmtrain's load_for_inference
    maps     analyze_document(model, doc, layers) -> DocAttention (recomputed rows: mass, entropy,
             sink, per-medium token-grid maps); batch_attention_stats(...) for packed batches
    metrics  pointing_trials / summarize_trials / AttentionTotals / Grounding (metrics.json content)
Pictures and the report: plots, render, report; the command line: cli (session runs one invocation).
See docs/ATTENTION_MAPS.md.
"""
