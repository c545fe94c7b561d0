"""manifest.py spells the checkpoint's file names itself (checkpoint.py imports it, not the reverse)."""

from mmtrain.state import checkpoint, manifest


def test_manifest_names_a_ranks_files_as_checkpoint_writes_them():
    assert (manifest.DCP_DIR, manifest.RANK_FILE) == (checkpoint.DCP_DIR, checkpoint.RANK_FILE)
