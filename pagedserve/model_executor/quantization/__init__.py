"""How a linear layer holds and multiplies its weight (vLLM's QuantizationConfig / LinearMethod shape): base.py the
contract, one file per format (unquantized.py, int8.py), registry.py the `--quantization` names."""
