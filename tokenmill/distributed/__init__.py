"""Tensor and pipeline parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

    layout.py      where each rank sits (stage, TP rank) and which layers and heads it holds
    comm.py        the process groups and timed collectives the model layers call
    rendezvous.py  torch.distributed's init from the engine's options or a torchrun environment
    control.py     the driver <-> worker control channel (step messages, hello, errors)
    worker.py      one rank's process: build its shard, run every step it is sent
    executor.py    the driver's side: start the workers, send each step, collect its result
"""
