// Small integer helpers shared by the layouts (sizes, alignments).
#pragma once

#include <cstdint>

namespace torch_mp_ext {

/// `n` rounded up to a multiple of `to` (> 0).
constexpr uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace torch_mp_ext
