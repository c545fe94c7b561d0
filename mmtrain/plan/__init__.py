"""`mmtrain plan`: the real parallelize and training step of a config at N ranks, on fake tensors
under a fake process group, before any GPU is rented.

    gpus.py      the GPU specs the roofline and the memory verdict read (`--gpu`)
    batch.py     a packed batch at the config's real sizes: real metadata, fake pixels
    standin.py   what is traced in place of what fake tensors cannot run (attention kernels,
                 EP split sizes, host reads)
    trace.py     the fake process group, the mesh, parallelize, two steps under the trackers
    tracker.py   FSDPMemTracker with a cheaper per-op peak update (the same numbers)
    comm.py      collectives by mesh dimension and kind, with wire bytes
    flops.py     FLOPs per step by component, counted by hand
    vision.py    the vision encoder's modelled cost per rank under each vision.balance mode
    report.py    the verdict, the roofline, text and JSON
    cli.py       `mmtrain plan CONFIG --gpus N --gpu NAME`
"""
