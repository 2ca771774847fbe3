"""The forward: ``CausalLM`` (model.py) over its weight forms (weights.py), attention, the static KV
cache and its rollback (kv.py), the pointwise kernels, the graph runner, timing, and loading from a
folder, the hub cache or a GGUF file (loader.py). It builds on engine/cpu for the block products and
knows nothing of drafting or sampling."""
