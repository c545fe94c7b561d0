"""Scale-out beyond data parallelism, on torch.distributed's own DeviceMesh and DTensor: the mesh
(`dims.py`), expert parallelism (`expert_parallel.py`), context parallelism's collectives
(`context_parallel.py`) and what both share (`comm.py`: the autograd all-to-all, byte counts);
mmtrain/parallelize.py applies them."""
