"""Activation paging: the tensors autograd saves for backward wait in pinned host memory instead of GPU
memory.

paging.py   activation_paging(), the context (public as trainstream.activation_paging)
offload.py  wrap(activation_offload=...): the wrapped model's forward runs inside it
"""
