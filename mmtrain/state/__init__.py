"""State: what a run leaves on disk and reads back -- the run directory, checkpoints (atomic,
verified, reshardable) and the consolidated export. Nothing here knows the loop: the trainer hands
over its named Stateful parts, and these modules store, verify and load them.

    run_dir.py      the run directory: created or reused to resume, the resolved config
    checkpoint.py   RUN/step_<N>/: DCP shards, state.pt, rank_<r>.pt, async saves; load_for_inference
    train_state.py  the checkpoint's parts (model, optim, train, data, rng, ...), formats 1-3
    manifest.py     every file's size and SHA-256, written last; verifying a checkpoint
    export.py       `mmtrain export`: model.safetensors + config.yaml + tokenizer.json
"""
