"""The loop: `Trainer` steps, evaluates and checkpoints, and calls its callbacks (the interface is
mmtrain/callbacks.py, one level up, since every subsystem implements it and the trainer imports
every subsystem). It is the top of the trainer: nothing else in mmtrain imports this package
(`python -m mmtrain.train` and the tests do).

    trainer.py  Trainer: resume, the step (micro-batches -> Objective -> optimizer), eval, checkpoints
    perf.py     throughput, MFU and memory, and the Throughput callback
    logger.py   TensorBoard scalars, the progress line, log files, metrics.jsonl
    faults.py   fault injection (`train.faults`), the last callback
"""
