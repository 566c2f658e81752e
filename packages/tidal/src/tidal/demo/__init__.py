"""The demo: a small byte-level GPT fine-tuned on the Python standard library's source under a VRAM budget."""
