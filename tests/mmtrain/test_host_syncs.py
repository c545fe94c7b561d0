"""The device-to-host syncs of one training step, counted on the CPU and pinned site by site.

Each sync drains a GPU's launch queue, and nothing on a CPU shows one; so the non-log step's
forward, backward and optimizer step are run under `HostSyncs` and every site that reads the device
on the host is listed below with why it must. A new sync (a stray `.item()`, a boolean mask, a
`nonzero`) or more of an old one fails here. The batches are read before counting: the loader's
reads are of host tensors, before the copy to the device.
"""

from __future__ import annotations

import pytest

from mmtrain.loop.host_syncs import HostSyncs

# "path function" -> (most syncs a step, why it is there). The tiny test config: 2 decoder layers
# (one sparse, one full), 2 rows, images, video and text.
ALLOWED: dict[str, tuple[int, str]] = {
    # the loop: the skip decision (a non-finite loss or gradient norm) must precede the update
    "mmtrain/objectives/sums.py floats": (1, "the step's sums, loss and non-finite flag: one read"),
    "mmtrain/loop/trainer.py train_step": (1, "the gradient norm, read after the sums (queue drained)"),
    # the vision encoder plans its packed media on the host (block-diagonal layout, size order)
    "models/vision.py patch_layout": (1, "the (M, 3) media grids: the packed layout and its check"),
    "models/vision.py size_order": (1, "the media sizes: one batched attention call per equal size"),
    # attention: what is read once per forward (cached in meta) and shared by every layer
    "models/attention/meta.py <lambda>": (3, "aligned_blocks (no max_docs), has_spans, docs_contiguous"),
    "models/attention/select.py _select": (1, "a chunk's earliest document start (the scan's bound)"),
    "models/attention/blocks.py _ranges": (1, "the width of the kept-block lists"),
    "models/attention/blocks.py _dedupe": (1, "the width of the deduplicated lists"),
    # the CPU full-layer backend (auto -> flex on CUDA): segments planned per row on the host, where
    # a read costs nothing (2 rows here: a count per row)
    "models/attention/sdpa.py _runs": (6, "the document runs of each row"),
    "models/attention/sdpa.py plan_row": (12, "each row's segment plan"),
}


@pytest.fixture(scope="module")
def counted(raw_for, tmp_path_factory):
    from objective_steps import make_trainer

    trainer = make_trainer(raw_for, tmp_path_factory, "syncs", ["data.batch_size=2", "train.log_every=100"])
    source = trainer._batches()
    batches = [next(source) for _ in range(2)]
    trainer.train_step(iter(batches[:1]))  # the first step builds what is built once
    with HostSyncs() as syncs:
        trainer.train_step(iter(batches[1:]))
    return syncs.by_site(lines=False)


def test_every_sync_of_a_training_step_is_a_listed_one(counted):
    unlisted = {site: dict(ops) for site, ops in counted.items() if site not in ALLOWED}
    assert not unlisted, f"new device-to-host syncs in the training step: {unlisted}"


def test_no_listed_site_syncs_more_than_its_count(counted):
    over = {site: (sum(ops.values()), ALLOWED[site][0]) for site, ops in counted.items()
            if site in ALLOWED and sum(ops.values()) > ALLOWED[site][0]}
    assert not over, f"(counted, allowed): {over}"
