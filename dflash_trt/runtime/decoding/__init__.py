"""The pieces every decoding path shares, the reference loop and the batched runtime alike.

- ``tokens``: the tokenizer contract, text <-> ids the same on every path (no torch: the CLI and
  the serving front import it);
- ``sampling``: every token draw (temperature, top-p, seeds), the same for DFlash and plain decoding;
- ``rejection``: the rejection test of a block of sampled drafts, lossless for any q;
- ``results``: what a decoding returns (:class:`GenerationResult`), ended the same by every runtime.

The loops themselves: runtime/reference/ (one sequence) and runtime/batched/ (many).
"""
