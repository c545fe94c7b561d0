"""Evaluation and diagnostics: what the model has learnt, measured without moving it -- eval mode,
no grad, RNG saved and restored, sums all-reduced so every rank sees the same numbers. The loop
runs them at its eval steps and as callbacks; mmtrain-attn shares the pointing game.

    evaluate.py              per-task loss and accuracy, the reliance gap; mismatched media
    dist_eval.py             evaluation across ranks: disjoint shares, padded forwards, reduced sums
    diagnostics.py           collapse diagnostics: gaps, attention mass, expert load, effective rank
    diagnostics_report.py    their config (thresholds), result, scalars and alarms
    diagnostics_callback.py  the diagnostics as a callback (start, every N steps, end)
    pointing.py              the pointing game on a token grid
    probe.py                 linear probes of the ViT's features over object boxes vs raw pixels
    captioning.py            greedy captions of val media, scored on the attribute words (a callback)
    caption_config.py        its config (section `captions`), apart so that run_config can compose it
    report.py                the end-of-run tables
"""
