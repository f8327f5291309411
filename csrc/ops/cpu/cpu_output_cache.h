// Where large CPU outputs of rope.apply / rope.apply_backward come from.
#pragma once

#include <torch/csrc/stable/tensor.h>

namespace rope {

// An uninitialized contiguous tensor with `like`'s sizes, dtype and device (CPU), for an output
// the caller overwrites completely. Outputs of at least 16 MiB come from a cache of recycled
// blocks whose pages are already backed, so the OS does not fault and zero every page of each
// new output again (that costs more than the rotation: bench/NOTES.md 2 and 10). Smaller ones,
// and every one when the cache is off or torch lacks torch_from_blob (torch < 2.11), are plain
// torch allocations.
torch::stable::Tensor new_cpu_output(const torch::stable::Tensor& like);

}  // namespace rope
