"""Tensor parallelism on torch.distributed (NCCL on CUDA, gloo on CPU).

  group.py    the process groups of this rank and the collectives the layers call
  layers.py   vocab-parallel embedding / LM head, and each rank's slice of the checkpoint
  step.py     the step broadcast: rank 0 -> the other ranks, one message per step
  runner.py   rank 0's runner (broadcasts, samples) and the other ranks' step loop
  launch.py   starting and watching the rank processes; multi-node rendezvous
  worker.py   the process main of a rank other than 0
  checks.py   what is refused before any rank starts

The scheduler runs once, on rank 0, inside the engine's process; the other ranks receive
its batches and never schedule (DESIGN.md).
"""
