"""HF integration: packed forward passes of any HF causal LM through agentrl_fast ops."""
