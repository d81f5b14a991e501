"""Triton kernels for the paged KV cache (``store_kv``, ``paged_decode``) and their pure-torch
references (``reference``). Import the submodule you need: the references work without Triton."""
