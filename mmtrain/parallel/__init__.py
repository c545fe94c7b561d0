"""Distributed setup: the process group and everything that spreads one run over several ranks, on
torch.distributed's own DeviceMesh and DTensor. The rest of the trainer asks this package which
rank it is (`DistEnv`) and for a few collectives; the model files never see it.

    config.py            DistConfig (section `dist`)
    distributed.py       the process group under torchrun, DistEnv, the collectives (no-ops alone)
    dims.py              the device mesh from `dist.*`: dense and expert meshes, cp groups, dp slots
    parallelize.py       applied from outside the model: activation checkpointing, compile, EP, FSDP2/DDP
    expert_parallel.py   routed experts sharded over `ep`, an all-to-all dispatcher
    context_parallel.py  context parallelism's collectives (models/attention/context.py calls them)
    comm.py              what EP and CP share: the autograd all-to-all, per-step byte counts
    calls.py             the last collectives entered (op, group, shape, call site): named on a timeout
"""
