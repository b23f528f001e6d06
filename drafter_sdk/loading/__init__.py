"""Models and tokenizers, loaded the same way by the verifier (its target) and the model drafter (its
draft model): a Hugging Face folder, a .gguf read in one pass or converted once, the embedded default.
Needs the torch extra, so `import drafter_sdk` never imports this package's modules."""
