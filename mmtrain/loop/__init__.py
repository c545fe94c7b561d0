"""The loop: `Trainer` steps, evaluates and checkpoints, and calls its callbacks (the interface is
mmtrain/callbacks.py, one level up, since every subsystem implements it and the trainer imports
every subsystem). It is the top of the trainer: nothing else in mmtrain imports this package
(`python -m mmtrain.train` and the tests do).

    trainer.py  Trainer: resume, the step (train module -> clip -> optimizer), eval, checkpoints
    train_module.py  what the trainer steps: the model(s) and a step's forward and backward, one
                call at dist.pp == 1 and > 1 (pipeline_step.py: the pipeline schedule's step)
    perf.py     throughput, MFU and memory, and the Throughput callback
    logger.py   TensorBoard scalars, the progress line, log files, metrics.jsonl
    faults.py   fault injection (`train.faults`), the last callback
    heartbeat.py  the watchdog that names a silent rank (`train.heartbeat`)
"""
