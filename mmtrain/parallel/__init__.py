"""Scale-out beyond data parallelism, on torch.distributed's own DeviceMesh and DTensor: the mesh
(`dims.py`) and expert parallelism (`expert_parallel.py`); mmtrain/parallelize.py applies them."""
