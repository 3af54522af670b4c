"""The worker's CPU kernels: C loops built at start (attention over bfloat16 KV, one-pass
RMSNorm and rotary embedding) and oneDNN-prepacked linear weights.

Each module keeps the torch path it replaces as its fallback: where a kernel cannot be
built or does not apply, the worker runs transformers' and torch's own code.
"""
