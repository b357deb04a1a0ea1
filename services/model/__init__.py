"""Models: the native Llama-family target, EAGLE draft heads, the KV cache and checkpoint loading.

Written for one device; tensor parallelism is a later transform over the named linears (`linear.py`:
Linear, and PackedLinear with its per-projection split sizes)."""
