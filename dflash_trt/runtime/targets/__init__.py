"""The target model as every runtime runs it: loaded, adapted, and its forward pass.

- ``loading``: the target and its tokenizer from a checkpoint directory (safetensors, no remote code);
- ``adapter``: :class:`TargetAdapter`, the four things a decoding loop needs of any causal LM
  (embedding, head, forward with the drafter's features, KV rollback);
- ``lean_forward``: the Llama-family forward written out once, bit for bit transformers';
- ``gqa_attention``: grouped-query attention over the KV cache without copying it per head.

The drafters reuse the last two (a drafter's layers are Qwen3 layers over the target's features).
"""
