"""Triton kernels of agentrl_fast, installed as ``agentrl_fast.kernels``.

This package imports triton and nothing of torch, so every kernel can be compiled ahead of time
(for example for sm_90 in CI, which has no GPU) in an environment without torch.
"""
