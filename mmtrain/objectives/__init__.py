"""Objectives: what the model is trained toward and on -- every loss term of a micro-batch, the
weights of the tasks' losses (the balancers) and the train mixture (the controller, curriculum
stages). The loop calls `Objective` per micro-batch and step; the rest are callbacks it runs.

    objective.py        the forward of each micro-batch, the task losses, what the step did (StepSums)
    loss_terms/         the registry of loss terms (one file a term): token weighting's hook, MoE aux,
                        visual SSL, visual next, the contrast, z-loss
    chunked_ce.py       the LM head + cross-entropy chunk by chunk (`loss.ce_chunk`): no (B, S, V)
    heads.py            per-token CE / lse from the full logits (reference) or the chunked head
    terms.py            per-task losses, z-loss, head gradients, reliance weights; batch helpers
    token_weighting.py  token reliance weighting: the blank pass and the reweighted media losses
    sums.py             self-reducing sums: one float64 all-reduce per step
    balance/            loss-weight balancers, a registry of kinds, and the signals they read
    mixture.py          the reliance-driven mixture controller (`data.mix.controller`)
    curriculum.py       curriculum stages (`train.stages`)
"""
