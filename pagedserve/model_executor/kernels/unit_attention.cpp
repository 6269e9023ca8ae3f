// One translation unit of the kernels (build_config.UNITS): the attention kernels, the per-layer small ops and the
// Python bindings. Each file below stays one responsibility; they are compiled together so that ATen's headers are
// parsed once per unit instead of once per file.
#include "decode_attention.cpp"
#include "prefill_attention.cpp"
#include "kv_write.cpp"
#include "layer_ops.cpp"
#include "decode_layers.cpp"
#include "bindings.cpp"
