"""The building blocks models are made of: norm.py, rotary.py, activation.py, linear.py (delegating to its
quantization method), embedding.py, decoder.py (the attention, MLP and decoder layer that families configure) and
fused_decode.py (the native whole-stack decode a model opts into)."""
